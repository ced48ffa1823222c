"""The primitives that wire the autograd Functions into module instances, and division's entries in
Transformers' attention interface; ``model_patches`` builds its families from them.

Importing any of them checks the Transformers version first (:func:`check_transformers`).
"""
import transformers
from packaging.version import Version

#: The first Transformers whose ``GradientCheckpointingLayer`` checkpoints inside ``forward`` (a
#: wrapper set on the class, the plain ``forward`` as its ``__wrapped__``, which
#: ``primitives.patch_checkpointing`` calls) and whose models have
#: ``activation_checkpointing_enable``. Earlier 5.x releases checkpoint in ``__call__``, around
#: division's own checkpointing.
MIN_TRANSFORMERS = (5, 23)


def check_transformers(version: str) -> None:
    """An ImportError naming both versions where ``version`` is older than :data:`MIN_TRANSFORMERS`."""
    if Version(version).release[:2] < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"hf-division needs Transformers >= {need}, found {version}: "
                          f"pip install 'transformers>={need},<6'")


check_transformers(transformers.__version__)

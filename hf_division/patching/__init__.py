"""The primitives that wire the autograd Functions into module instances, and division's entries in
Transformers' attention interface; ``model_patches`` builds its families from them.

Importing any of them checks the PyTorch and Transformers versions first (:func:`check_torch`,
:func:`check_transformers`).
"""
import torch
import transformers
from packaging.version import Version

#: The first Transformers whose ``GradientCheckpointingLayer`` checkpoints inside ``forward`` (a
#: wrapper set on the class, the plain ``forward`` as its ``__wrapped__``, which
#: ``checkpointing.patch_checkpointing`` calls) and whose models have
#: ``activation_checkpointing_enable``. Earlier 5.x releases checkpoint in ``__call__``, around
#: division's own checkpointing.
MIN_TRANSFORMERS = (5, 23)


#: The oldest PyTorch the whole suite has passed under (docs/GUIDE.md, "Install"; 2.11 is the lent
#: GPU machines'). Older ones differ where division depends on them: 2.11's ``torch.Generator``
#: took no weak reference and its Dynamo traced the patched root forward's checks wrongly, each
#: found only by running the suite there.
MIN_TORCH = (2, 11)


def _check(name: str, version: str, minimum: tuple, spec: str) -> None:
    if Version(version).release[:2] < minimum:
        need = ".".join(map(str, minimum))
        raise ImportError(f"hf-division needs {name} >= {need}, found {version}: pip install '{spec.format(need)}'")


def check_transformers(version: str) -> None:
    """An ImportError naming both versions where ``version`` is older than :data:`MIN_TRANSFORMERS`."""
    _check("Transformers", version, MIN_TRANSFORMERS, "transformers>={},<6")


def check_torch(version: str) -> None:
    """An ImportError naming both versions where ``version`` is older than :data:`MIN_TORCH`."""
    _check("PyTorch", version, MIN_TORCH, "torch>={},<2.15")


check_torch(torch.__version__)
check_transformers(transformers.__version__)

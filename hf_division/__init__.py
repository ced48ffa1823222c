"""hf-division: DIVISION-compressed activations for Hugging Face training (one flag).

The package is built in layers, each importing only from the ones listed before it
(docs/DESIGN.md, "Layering"; ``tests/test_layering.py`` checks it):

========================  ===================================================================
``config``, ``registry``  the policy: what is compressed how; model type -> family
``quant/``                the math: pure tensor functions and the ``Packed`` format
``kernels/``              how it runs: native C, ``torch.compile``; ``configure()`` for every switch
``compress/``             the pipeline: ``compress`` / ``decompress``, one backend per tensor; noise
``autograd/``             the store of compressed copies and the autograd Functions that keep them
``patching/``             the primitives that wire Functions into module instances
``model_patches``         one module per architecture family (a package beside this one)
``api``                   ``apply_division`` / ``remove_division``
``integrations/``         Trainer, TRL, Accelerate, ``hf-division run``, the command line
``analysis/``             exact bytes, gradient fidelity, auto-precision, budget mode
``bench/``                the measurement harness: suites, models, data, peak memory, timing, demo
========================  ===================================================================

``import hf_division`` imports none of them: each public name below loads its module on first use
(PEP 562), so importing the package costs nothing and no modeling file is loaded before a model
of its family is patched.
"""
import importlib

#: public name -> module that defines it
_PUBLIC = {
    "DivisionConfig": "hf_division.config",
    "apply_division": "hf_division.api",
    "remove_division": "hf_division.api",
    "supported_model_types": "hf_division.api",
    "exact": "hf_division.autograd.store",
    "configure": "hf_division.kernels.switches",
    "configured": "hf_division.kernels.switches",
    "measure_activation_memory": "hf_division.analysis.measure",
    "suggest": "hf_division.analysis.budget",
    "TrainingArguments": "hf_division.integrations.trainer",
    "Trainer": "hf_division.integrations.trainer",
    "enable": "hf_division.integrations.trainer",
    "disable": "hf_division.integrations.trainer",
    "with_division": "hf_division.integrations.trainer",
}

__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'hf_division' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))

import os

# Each pytest-xdist worker is one of several processes that compile with inductor; by default
# inductor compiles in a pool of worker processes, which aborted or hung multi-process CPU runs
# (docs/GUIDE.md, "Distributed"). The workers compile in-process: set before torch reads its
# inductor config, and inherited by every process a test launches. A lone run (a GPU machine's
# tests/test_cuda.py) keeps the pool.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

# Without a CUDA device the Triton kernels run on CPU tensors under Triton's interpreter, which
# Triton chooses when it is first imported (Transformers imports it): tests/test_triton.py
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("HF_DIVISION_TEST_REPATCH") != "1":
    import interpreter_calls  # tests/: the interpreter spared its re-patching (its doc says why and how much)

    interpreter_calls.install()

from transformers import LlamaConfig, LlamaForCausalLM

from hf_division.bench import tiny_models as tiny
from hf_division.bench.tiny_models import case, pixel_batch, tiny_batch, tiny_config
from hf_division.kernels import triton_codec

# The README's test command runs one pytest-xdist worker per core: each worker gets its share of
# the cores, so workers do not oversubscribe them (a lone run keeps the 2 threads it always had)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS) if _WORKERS else 2)


@pytest.fixture(autouse=True)
def _threads_kept():
    """The suites' ``main`` sets torch's threads for its measurements (2, the measuring machine's
    cores); called in a test, it left them so for every later test of its worker, and two workers
    of 2 threads each oversubscribed the cores. Each test ends with its worker's count restored."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def pytest_configure(config):
    # a file of 40 s or more of test time (--durations=0 on a 2-core machine) has pytest.mark.heavy
    # in its pytestmark
    config.addinivalue_line("markers", "heavy: a test file among the suite's slowest; pytest-xdist starts it first")
    # --dist loadfile hands each worker whole files, by default those with the most tests first: the
    # few-test files that take minutes (a real model's load, two launched processes) came last and
    # one worker ran them alone at the end. The collection's order instead, heavy files first.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: files stay whole


#: the Triton kernels' tests run on a CUDA device, or on CPU tensors under Triton's interpreter,
#: each on the Triton path (:func:`triton_path`)
TRITON_MARKS = [
    pytest.mark.skipif(not triton_codec.available(), reason="Triton is not installed (pip install hf-division[test])"),
    pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="no CUDA device and TRITON_INTERPRET is not 1"),
    pytest.mark.usefixtures("triton_path"),
]


@pytest.fixture
def triton_path():
    """The test's tensors on the Triton kernels' path, CPU tensors included (``triton_codec.on_cpu``):
    every test marked :data:`TRITON_MARKS`; a reference inside it turns the kernels off itself."""
    with triton_codec.on_cpu():
        yield


#: one unit in the last place of each float dtype, relative
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

#: A launched child's limit in seconds: below pytest's per-test timeout (pyproject.toml), so the
#: child's own timeout fires first and the failure names its command
CHILD_TIMEOUT_S = 240

ENCODER_TYPES = ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]


def tiny_model(model_type: str, attn: str = "eager", seed: int = 0, **kw):
    """:func:`hf_division.bench.tiny_models.tiny_model`; skips the test where Transformers lacks ``attn``."""
    try:
        return tiny.tiny_model(model_type, attn, seed, **kw)
    except ValueError as err:
        if not tiny.has_impl(err):
            pytest.skip(f"{model_type} has no {attn} attention in Transformers")
        raise


def switched_steps(switch: str, device: str) -> tuple:
    """The cuda suite's ``tiny`` Llama with division (rounding to nearest) trains one step on the GPU's
    path under bf16 autocast with the fast path ``switch`` on, then one with it off:
    ``(layers, {on: (the flat gradient, the step's KernelCounter)})``. How a layer kernel's test
    checks that a step takes it, by its launches and against what it replaces. No set-up step
    first: rounding to nearest draws no seed blocks, and a fresh model's first step on this path
    runs the ops and launches of its second (one-time ops would show in the "on" step's counts,
    which the rotary test compares exactly)."""
    import hf_division as hd
    from hf_division.analysis.fidelity import flat_grad
    from hf_division.analysis.launches import GPU_SWITCHES, KernelCounter
    from hf_division.bench.suites import cuda as cuda_suite
    from hf_division.kernels import configured

    model = cuda_suite.build("tiny", device)
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    hd.apply_division(model, hd.DivisionConfig(rounding="nearest"))
    out = {}
    with configured(**GPU_SWITCHES):
        for on in (True, False):
            with configured(**{switch: on}), KernelCounter() as counted:
                out[on] = (flat_grad(model, batch, 0, torch.bfloat16), counted)
    return model.config.num_hidden_layers, out


def eval_before_and_after(model, inputs: dict, change):
    """``(output before, output after change(model))`` of ``model`` in eval mode under ``no_grad``:
    what the promise of an untouched eval forward compares."""
    model.eval()
    with torch.no_grad():
        before = model(**inputs)
    change(model)
    with torch.no_grad():
        return before, model(**inputs)


@pytest.fixture
def enabled_division():
    """``hf_division.enable()`` for the test, ``disable()`` after it."""
    import hf_division

    hf_division.enable()
    yield
    hf_division.disable()


@pytest.fixture
def batch():
    return tiny_batch()


@pytest.fixture
def padded_llama():
    """``make(tokens, pad_from)``: a 2-layer float64 Llama in training mode and a batch of 2 rows
    of ``tokens``, the second right-padded from ``pad_from`` (labels -100 there): the shape the
    analysis modules (``first_token``, ``gated_mlp``) read their hooks from."""
    def make(tokens: int, pad_from: int):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).double().train()
        ids = torch.randint(0, 97, (2, tokens), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, pad_from:] = 0
        return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return make

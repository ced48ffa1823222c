"""The GLUE pieces of ``hf_division.bench.glue`` on the bundled fixtures (the original TSV layout, 24 rows
per split), ``scripts/run_glue.py`` end to end, and ``hf-division run`` on an unmodified example-style
script."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from hf_division.bench.glue import (
    build_model, compute_metrics, load_raw, metrics_for, parse_args, read_split, tokenize_splits,
)
from hf_division.integrations.trainer import Trainer
from hf_division.bench.zoo import minilm_path

from conftest import CHILD_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLUE = os.path.join(ROOT, "tests", "fixtures", "glue")
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer random-init BERT encoder with the real MiniLM tokenizer, saved like a hub model."""
    path = tmp_path_factory.mktemp("tiny-bert")
    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(path)  # no head: each task gets its own, as from a hub checkpoint
    tok.save_pretrained(path)
    return str(path)


def _args(model_dir, out, task, *extra):
    return ["--model_name_or_path", model_dir, "--glue_dir", GLUE, "--task_name", task, "--do_train", "--do_eval",
            "--max_steps", "2", "--per_device_train_batch_size", "8", "--max_seq_length", "64",
            "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
            "--division_min_numel", "0", *extra]


METRIC = {"cola": "eval_matthews_correlation", "sst2": "eval_accuracy", "mrpc": "eval_f1", "stsb": "eval_pearson",
          "rte": "eval_accuracy", "wnli": "eval_accuracy"}


@pytest.mark.parametrize("task", sorted(METRIC))
def test_every_glue_task_with_division(task, tiny_bert_dir, tmp_path):
    model_args, data_args, training_args, lora_args = parse_args(_args(tiny_bert_dir, tmp_path, task, "--division"))
    raw, num_labels, regression = load_raw(data_args, training_args)
    assert set(raw) == {"train", "validation"} and (num_labels, regression) == ((1, True) if task == "stsb" else (2, False))
    model = build_model(model_args, num_labels, regression, lora_args)
    data, collator = tokenize_splits(raw, AutoTokenizer.from_pretrained(tiny_bert_dir), data_args)
    assert all(len(ex["input_ids"]) == 64 for ex in data["train"])  # padded to max_seq_length
    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["validation"],
                      data_collator=collator, compute_metrics=metrics_for(data_args.task_name, regression))
    assert trainer.train().global_step == 2
    assert METRIC[task] in trainer.evaluate()


def test_run_glue_script_with_lora_and_json_args_file(tiny_bert_dir, tmp_path):
    args = _args(tiny_bert_dir, tmp_path / "out", "mrpc", "--division", "--use_lora", "--lora_r", "4",
                 "--lora_target_modules", "query", "value", "--pad_to_max_length", "false")
    # the same arguments as one JSON file (the Transformers example convention)
    keys = [a[2:] for a in args if a.startswith("--")]
    parsed = {}
    i = 0
    while i < len(args):
        key = args[i][2:]
        values = []
        i += 1
        while i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        if key == "lora_target_modules":
            parsed[key] = values
        else:
            value = values[0] if values else "true"
            parsed[key] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    assert set(keys) == set(parsed)
    path = tmp_path / "args.json"
    path.write_text(json.dumps(parsed))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "run_glue.py"), str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "division_report.json").read_text())
    assert report["use_lora"] and report["division"] and report["task_name"] == "mrpc"
    assert os.path.isfile(out / "adapter_config.json")
    mem = report["activation_memory"]
    assert 0 < mem["division_bytes"] < mem["baseline_bytes"]
    assert report["peak_memory_bytes"] > 0 and report["train_runtime_s"] > 0
    saved = json.loads((out / "all_results.json").read_text())
    assert saved["eval_f1"] == pytest.approx(report["metrics"]["eval_f1"])
    assert saved["activation_division_bytes"] == mem["division_bytes"]
    assert "activation bytes held for backward" in proc.stdout


def test_bad_inputs_name_the_problem(tiny_bert_dir, tmp_path):
    with pytest.raises(ValueError, match="task_name 'mnlx'"):
        parse_args(_args(tiny_bert_dir, tmp_path, "mnlx"))
    _, data_args, training_args, _ = parse_args(_args(tiny_bert_dir, tmp_path, "qnli"))
    with pytest.raises(FileNotFoundError, match="no train file"):
        load_raw(data_args, training_args)  # QNLI ships no train.tsv
    with pytest.raises(ValueError, match="division_linear_bits"):
        parse_args(_args(tiny_bert_dir, tmp_path, "rte", "--division_linear_bits", "3"))


def test_tsv_quirks_and_metrics():
    mrpc = read_split(GLUE, "mrpc", "train")  # header starts with a BOM
    assert len(mrpc["label"]) == 24 and set(mrpc["label"]) <= {0, 1}
    cola = read_split(GLUE, "CoLA", "dev")  # no header
    assert len(cola["label"]) == 25
    rte = read_split(GLUE, "rte", "dev")  # string labels
    assert set(rte["label"]) <= {0, 1}
    stsb = read_split(GLUE, "sts-b", "train")
    assert all(isinstance(x, float) for x in stsb["label"])
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 3.0]]).numpy()
    labels = torch.tensor([0, 1, 1, 1]).numpy()
    assert compute_metrics("mrpc", logits, labels) == pytest.approx(
        {"accuracy": 0.75, "f1": 0.8, "combined_score": 0.775})
    assert compute_metrics("cola", logits, labels)["matthews_correlation"] == pytest.approx(0.5773502691896258)
    s = compute_metrics("stsb", torch.tensor([[1.0], [2.0], [3.0]]).numpy(), torch.tensor([1.0, 2.5, 2.9]).numpy())
    assert s["spearmanr"] == pytest.approx(1.0) and 0.9 < s["pearson"] < 1.0


EXAMPLE = '''
"""An unmodified Transformers-example-style script: it knows nothing about hf-division."""
import json, os
import torch
from datasets import Dataset
from transformers import (AutoModelForSequenceClassification, HfArgumentParser, Trainer,
                          TrainingArguments)


def main():
    (args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()
    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(os.path.dirname(args.output_dir), "model"))
    g = torch.Generator().manual_seed(0)
    ds = Dataset.from_dict({"input_ids": torch.randint(5, 500, (16, 64), generator=g).tolist(),
                            "labels": torch.randint(0, 2, (16,), generator=g).tolist()})
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    from hf_division.api import division_config_of  # only to report what hf-division did

    patched = division_config_of(model)
    with open(args.output_dir + "/seen.json", "w") as f:
        json.dump({"division": getattr(args, "division", None),
                   "block_size": getattr(args, "division_block_size", None),
                   "patched": patched is not None,
                   "block_size_used": patched.block_size if patched else None}, f)


if __name__ == "__main__":
    main()
'''


def test_unmodified_script_runs_with_division(tiny_bert_dir, tmp_path):
    entry = ["-m", "hf_division.integrations.cli", "run"]  # ``hf-division run``, which calls ``python -m hf_division.integrations.launcher``
    script = tmp_path / "example.py"
    script.write_text(EXAMPLE)
    (tmp_path / "model").symlink_to(tiny_bert_dir)
    out = tmp_path / "out"
    cmd = [sys.executable, *entry, str(script), "--output_dir", str(out), "--max_steps", "2",
           "--per_device_train_batch_size", "8", "--report_to", "none", "--save_strategy", "no",
           "--division", "--division_block_size", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads((out / "seen.json").read_text())
    assert seen == {"division": True, "block_size": 8, "patched": True, "block_size_used": 8}


def test_run_without_division_flag_leaves_model_alone(tiny_bert_dir, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(EXAMPLE)
    (tmp_path / "model").symlink_to(tiny_bert_dir)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_division.integrations.launcher", str(script), "--output_dir", str(out), "--max_steps", "1",
           "--report_to", "none", "--save_strategy", "no"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "seen.json").read_text())["patched"] is False


def _save_tiny(model_type: str, path, tok) -> str:
    """A 2-layer random-init ``model_type`` encoder with the MiniLM tokenizer, saved like a hub model."""
    from transformers import AutoConfig, AutoModel

    special = dict(pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                   bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    cfg = AutoConfig.for_model(model_type, vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=128, max_position_embeddings=128, **special)
    torch.manual_seed(0)
    AutoModel.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", ["deberta-v2", "modernbert"])
def test_run_glue_pieces_with_other_encoders(model_type, tmp_path):
    """What ``scripts/run_glue.py`` runs, on a DeBERTa-v2 and a ModernBERT checkpoint (sentence pairs:
    ModernBERT takes no ``token_type_ids``, the Trainer drops them by the patched forward's signature)."""
    from hf_division.api import division_config_of

    tok = AutoTokenizer.from_pretrained(minilm_path())
    model_dir = _save_tiny(model_type, tmp_path / "model", tok)
    model_args, data_args, training_args, lora_args = parse_args(_args(model_dir, tmp_path / "out", "rte", "--division"))
    raw, num_labels, regression = load_raw(data_args, training_args)
    model = build_model(model_args, num_labels, regression, lora_args)
    data, collator = tokenize_splits(raw, tok, data_args)
    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["validation"],
                      data_collator=collator, compute_metrics=metrics_for(data_args.task_name, regression))
    assert trainer.train().global_step == 2
    assert division_config_of(model) is not None and model.config.model_type == model_type
    assert METRIC["rte"] in trainer.evaluate()

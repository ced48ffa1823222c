#!/usr/bin/env python
"""Fine-tune a GLUE task with a custom Accelerate loop (no Trainer), with or without division.

    python scripts/train_accelerate.py --glue_dir ../shared/data/glue --task_name sst2 --division \
        --max_steps 100 --output_dir out/acc-sst2
    accelerate launch --cpu --num_processes 2 scripts/train_accelerate.py --glue_dir ../shared/data/glue \
        --task_name rte --division --mixed_precision bf16 --gradient_accumulation_steps 2 --output_dir out/acc-rte

``--division`` and ``--division_<field>`` set the DivisionConfig (as for the Trainer). The model
defaults to the bundled MiniLM-L6 (``hf_division.bench.zoo.minilm_path()``). Writes
``OUTPUT_DIR/results.json``: the per-step training loss (mean over all processes and micro-batches
of the step), the dev metrics, and the run's settings.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

from hf_division.integrations.accelerate import (
    division_enabled, keep_process_group_until_exit, prepare_division, reseed_for_step,
)
from hf_division.bench.glue import compute_metrics, parse_loop_args, tokenized_examples
from hf_division.bench.zoo import minilm_path


def wrapper_name(model) -> str:
    """How ``prepare`` wrapped the model: its class, plus ``+DTensor`` if parameters are sharded (FSDP2)."""
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    return type(model).__name__ + ("+DTensor" if sharded else "")


def train_loop(args, accelerator, model, optimizer, scheduler, train_dl, max_steps: int) -> list[float]:
    """``max_steps`` optimizer steps; the loss of each (mean over processes and micro-batches)."""
    losses, step, running, new_step = [], 0, [], True
    model.train()
    while step < max_steps:
        for batch in train_dl:
            if new_step and args.division:  # first micro-batch of an optimizer step
                reseed_for_step(step, args.seed, accelerator)  # noise depends on (seed, step, rank) only
            new_step = False
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running.append(loss.detach().float())
            if accelerator.sync_gradients:
                step_loss = accelerator.reduce(torch.stack(running).mean(), "mean").item()
                losses.append(step_loss)
                running, new_step = [], True
                step += 1
                if step % args.logging_steps == 0:
                    accelerator.print(f"step {step}/{max_steps} loss {step_loss:.4f}")
                if step >= max_steps:
                    break
    return losses


def evaluate(args, accelerator, model, eval_dl) -> dict:
    """GLUE metrics on the dev split, predictions gathered from every process."""
    model.eval()
    preds, labels = [], []
    for batch in eval_dl:
        with torch.no_grad():
            logits = model(**batch).logits.float()
        logits, lab = accelerator.gather_for_metrics((logits, batch["labels"]))
        preds.append(logits.cpu())
        labels.append(lab.cpu())
    return compute_metrics(args.task_name, torch.cat(preds).numpy(), torch.cat(labels).numpy())


def main(argv=None) -> dict:
    args = parse_loop_args(argv)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.gradient_accumulation_steps,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ValueError("--mixed_precision fp16 on CPU: Accelerate would silently train in float32; use bf16")
    set_seed(args.seed)
    path = args.model_name_or_path or minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    data, task = tokenized_examples(args, tokenizer)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=task.num_labels, problem_type="regression" if task.is_regression else None)
    if args.division:
        prepare_division(model, args.division_config())  # before prepare: survives the DDP/FSDP wrapping

    train_dl = DataLoader(data["train"], batch_size=args.per_device_train_batch_size, shuffle=True)
    eval_dl = DataLoader(data["dev"], batch_size=args.per_device_eval_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / args.gradient_accumulation_steps)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    # Accelerate steps a prepared scheduler once per process per optimizer step (its convention for
    # schedules counted on the single-process dataloader), so the schedule spans max_steps x processes
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=max_steps * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    start = time.time()
    losses = train_loop(args, accelerator, model, optimizer, scheduler, train_dl, max_steps)
    train_time = time.time() - start
    metrics = evaluate(args, accelerator, model, eval_dl) if args.do_eval else {}
    applied = torch.tensor([float(division_enabled(model))], device=accelerator.device)
    results = {"task_name": args.task_name, "division": args.division,
               "division_applied_per_process": accelerator.gather(applied).tolist(), "division_config": args.division_config().to_dict(),
               "num_processes": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
               "distributed_type": str(accelerator.distributed_type), "model_wrapper": wrapper_name(model),
               "gradient_accumulation_steps": args.gradient_accumulation_steps,
               "per_device_train_batch_size": args.per_device_train_batch_size, "max_steps": max_steps, "seed": args.seed,
               "train_losses": losses, "eval_metrics": metrics, "train_time_s": train_time}
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        accelerator.print(f"done: {len(losses)} steps, final loss {losses[-1]:.4f}, dev {metrics}")
    keep_process_group_until_exit()  # the teardown that once hung (hf_division.integrations.accelerate)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()

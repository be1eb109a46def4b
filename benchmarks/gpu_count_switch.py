"""A run moved 2 GPUs -> 1 GPU -> 2 GPUs through its checkpoints: does it follow an uninterrupted run?

Every run is ``foundry train <yaml>`` on the same MDS data, seed and global batch:

- ``uninterrupted-2gpu``: all ``--batches`` on 2 GPUs (the reference);
- ``uninterrupted-1gpu``: the same on 1 GPU: how far two faithful runs drift apart in bf16 (the noise);
- ``switched``: three launches of ``--segment`` batches on 2, then 1, then 2 GPUs; each hands over
  (``callbacks.hand_over``) and the next one autoresumes from the checkpoint it left.

Reports |loss - reference| per run, and the relaunches' exit codes; ``--plot`` draws the loss curves::

    python benchmarks/gpu_count_switch.py --corpus a.txt --tokenizer DIR --out OUT --plot docs/images/gpu_switch.png
    # CPU smoke test (gloo ranks): --batches 6 --segment 2 --global-batch 4 --microbatch 1 --override \
    #     model.d_model=64 model.n_heads=2 model.n_layers=2 model.attn_config.attn_impl=sdpa precision=fp32
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench_utils import foundry_train, loss_gaps, plot_against_reference, save_json, train_losses
from default_path import build_data

from foundry.errors import EXIT_HANDED_OVER, EXIT_OK


def plot(result: dict, path: str) -> None:
    """Loss curves (top) and each run's loss minus the reference's (bottom), the GPU switches marked."""
    segment = result["args"]["segment"]
    curves = {name: {int(step): loss for step, loss in run["losses"].items()} for name, run in result["runs"].items()}
    titles = (
        "train loss; the switched run: 2 GPUs, then 1 (dotted lines: hand-overs), then 2",
        "difference from the uninterrupted 2-GPU run",
    )
    plot_against_reference(curves, "uninterrupted-2gpu", path, titles, marks=(segment, 2 * segment))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml", default="yamls/pretrain/mpt-125m.yaml")
    parser.add_argument("--corpus", nargs="+", help="text files for the MDS data (unless --data is given)")
    parser.add_argument("--data", default=None, help="MDS data already converted (2048-token samples)")
    parser.add_argument("--tokenizer")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--segment", type=int, default=20, help="batches per launch of the switched run")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=32)
    parser.add_argument("--work", default="/tmp/foundry-gpu-switch")
    parser.add_argument("--out", help="where the JSON and the runs' metrics.jsonl go (required unless --replot)")
    parser.add_argument("--plot", default=None, help="PNG of the three loss curves")
    parser.add_argument("--override", nargs="*", default=[], help="more key=value overrides for every run")
    parser.add_argument("--replot", default=None, help="only draw --plot from this saved gpu_count_switch.json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text())["rows"], args.plot)
        return 0
    work = Path(args.work)
    shutil.rmtree(work / "runs", ignore_errors=True)
    data = args.data or build_data(args.corpus, args.tokenizer, args.batches * args.global_batch + 200, work / "data")
    common = [
        f"variables.data_local={data}", f"tokenizer.name={args.tokenizer}", "eval_loader=null",
        f"max_duration={args.batches}ba", f"global_train_batch_size={args.global_batch}",
        f"device_train_microbatch_size={args.microbatch}", "callbacks.speed_monitor.warmup_batches=1", *args.override,
    ]  # fmt: skip
    runs = work / "runs"
    runs.mkdir(parents=True)
    exit_codes: dict[str, list[int]] = {}
    for name, nproc in (("uninterrupted-2gpu", 2), ("uninterrupted-1gpu", 1)):
        exit_codes[name] = [foundry_train(args.yaml, runs / name, [*common, f"run_name={name}"], nproc)]
    switched = runs / "switched"
    relaunch = [
        *common, "run_name=switched", f"callbacks.hand_over.interval={args.segment}ba", "autoresume=true",
        f"save_folder={switched}/checkpoints", "save_num_checkpoints_to_keep=1",
    ]  # fmt: skip
    exit_codes["switched"] = []
    for nproc in (2, 1, 2):
        exit_codes["switched"].append(foundry_train(args.yaml, switched, relaunch, nproc))
    reference = train_losses(runs / "uninterrupted-2gpu")
    result = {"args": vars(args), "exit_codes": exit_codes, "runs": {}}
    for name in ("uninterrupted-2gpu", "uninterrupted-1gpu", "switched"):
        curve = train_losses(runs / name)
        gaps = loss_gaps(curve, reference)
        result["runs"][name] = {
            "batches": len(curve),
            "first_loss": curve.get(1),
            "last_loss": curve.get(args.batches),
            "max_abs_gap": gaps["max_abs_gap"],
            "mean_abs_gap": gaps["mean_abs_gap"],
            "losses": curve,
        }
        print(name, {key: value for key, value in result["runs"][name].items() if key != "losses"}, flush=True)
    expected = [EXIT_HANDED_OVER, EXIT_HANDED_OVER, EXIT_OK]
    result["switched_exit_codes_as_expected"] = exit_codes["switched"] == expected
    save_json(args.out, "gpu_count_switch", result)
    for name in result["runs"]:
        shutil.copy(runs / name / "metrics.jsonl", Path(args.out) / f"{name}.metrics.jsonl")
    if args.plot:
        plot(result, args.plot)
    return 0 if result["switched_exit_codes_as_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())

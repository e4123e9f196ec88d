"""startup_memory: host memory of a node's startup, beyond its own state: making its model and resuming a checkpoint.

Each measure runs in a fresh subprocess (one torch thread). After its imports (and, for a resume, after the model is
made) it resets the kernel's resident-set high-water mark (`/proc/self/clear_refs`), notes the resident size, does
the work and reads the high-water mark (VmHWM). The first use of the meta device, which loads torch's meta
registrations (a one-off part of the runtime, reported as `meta_runtime`), comes before, as does the import of
transformers' OLMoE for the `--init-from` phases. On a CPU the model and its AdamW moments are the node's own state,
in the same memory; the measure is the growth beyond them, which is what the host of a GPU node holds at startup:

- make: the model of a preset with 1 shard trainable and the others frozen at the preset's precision, as the node
  makes it (`model.initial.initial_model`: on its device one weight at a time) and as it was built before (whole in
  fp32, `MoEForCausalLM`, then `apply_ownership`);
- resume: a checkpoint of that model as the node writes it (shared parameters and the held shard, frozen experts
  only if the preset checkpoints them, AdamW moments in fp32) is written once; a fresh process makes the model and
  reads the checkpoint into it and its optimizer state as `Node._resume` does (`ownership.load_state_in_place`,
  `Checkpoint.optimizer_part`), against torch's `load_state_dict` of safetensors' `load_file` (before), then reads
  every moment once, as the first optimizer step would (`load_file` maps the file: its tensors take memory when
  read). On a GPU node the difference is where the moments go: they are now read on to the device one at a time;
  before, they stayed in host memory, where a fused CUDA AdamW does not take them.

- init: the model's initial weights written as a Hugging Face checkpoint (`save_hf_checkpoint`, as `spes-node
  export` or `init` write them) are loaded into a fresh model as `--init-from` does (`load_hf_weights`: one layer's
  shard at a time from the files), against transformers' `from_pretrained` in fp32 then `from_hf_state_dict` and
  `load_dense_state_dict` (before).

Beside each: the plan's `host_startup` less its runtime term (one weight as it is made).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import LoadMonitor, emit, mib, python_cmd, reset_peak_rss, rss_kib, table, write_result

PHASES = ("make-new", "make-old", "write", "resume-new", "resume-old", "hf-write", "init-new", "init-old")
SETTINGS = {"preset": "spes-1b", "torch_threads": 1, "phases": list(PHASES)}


def _growth(work) -> tuple[object, int]:
    reset_peak_rss()
    baseline = rss_kib("VmRSS")
    result = work()
    return result, (rss_kib("VmHWM") - baseline) * 1024


def probe(kind: str, preset: str, directory: str) -> dict:
    """One measure in this process: `make-new`, `make-old`, `write`, `resume-new` or `resume-old`."""
    import torch

    from spes_node.allocator import keep_large_blocks_mapped
    from spes_node.config import load_preset
    from spes_node.daemon.checkpoint import CheckpointManager
    from spes_node.daemon.checkpoint_writer import frozen_expert_names
    from spes_node.model.initial import initial_model
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, load_state_in_place

    keep_large_blocks_mapped()  # as the node does first thing: freed temporaries go back to the kernel
    torch.set_num_threads(SETTINGS["torch_threads"])
    cfg = load_preset(preset)
    m, s = cfg.model, cfg.swarm

    def make():
        return initial_model(m, s.num_shards, cfg.train.seed, owned=[0], frozen_dtype=s.frozen_dtype)

    def stored(model) -> int:
        return sum(t.nbytes for t in model.state_dict().values())

    def warm_up():  # the meta device's first use loads torch's meta registrations: a one-off part of the runtime
        with torch.device("meta"):
            apply_ownership(MoEForCausalLM(load_preset("tiny").model, 4), [0], "int8")

    _, meta_runtime = _growth(warm_up)
    if kind == "make-new":
        model, growth = _growth(make)
        return {"growth": growth, "state": stored(model), "meta_runtime": meta_runtime}
    if kind == "make-old":

        def build():
            model = MoEForCausalLM(m, s.num_shards, seed=cfg.train.seed)
            apply_ownership(model, [0], s.frozen_dtype)
            return model

        model, growth = _growth(build)
        return {"growth": growth, "state": stored(model)}
    model = make()
    hf_dir = Path(directory) / "hf"
    if kind == "hf-write":
        from spes_node.model.hf_checkpoint import save_hf_checkpoint
        from spes_node.model.ownership import dense_state_dict
        from spes_node.model.tokenizer import load_tokenizer

        # the byte tokenizer: the preset's own would be downloaded, and only the weights are measured
        save_hf_checkpoint(cfg, dense_state_dict(model), hf_dir, tokenizer=load_tokenizer("bytes"))
        return {"bytes": sum(f.stat().st_size for f in hf_dir.iterdir())}
    if kind in ("init-new", "init-old"):

        def init_new():
            from spes_node.model.hf_checkpoint import load_hf_weights

            load_hf_weights(model, hf_dir)

        def init_old():
            from transformers import OlmoeForCausalLM

            from spes_node.model.hf_interop import from_hf_state_dict
            from spes_node.model.ownership import load_dense_state_dict

            hf_model = OlmoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            state = from_hf_state_dict(hf_model.state_dict(), s.num_shards)
            load_dense_state_dict(model, state)

        import transformers.models.olmoe.modeling_olmoe  # noqa: F401  (a one-off part of the runtime, as meta's)

        # the frozen shards' buffers are replaced as they load: the state is the model's, as before
        _, growth = _growth(init_new if kind == "init-new" else init_old)
        return {"growth": growth, "state": 0}
    if kind == "write":
        tensors = model.state_dict()
        if not cfg.train.checkpoint_frozen_experts:
            for name in frozen_expert_names(tensors, [0]):
                del tensors[name]
        by_name = {
            name: {
                "step": torch.tensor(1.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for name, p in model.named_parameters()
        }
        path = CheckpointManager(directory).save(1, tensors, {}, optimizer={"by_name": by_name})
        return {"bytes": sum(f.stat().st_size for f in path.iterdir())}

    def resume_new():
        checkpoint = CheckpointManager(directory).latest()
        load_state_in_place(model, checkpoint.tensors)
        return checkpoint.optimizer_part("by_name")

    def resume_old():
        from safetensors.torch import load_file

        from spes_node.daemon.checkpoint import unflatten_state

        checkpoint = CheckpointManager(directory).latest()
        model.load_state_dict(load_file(checkpoint.path / "model.safetensors"), strict=False)
        everything = load_file(checkpoint.path / "optimizer.safetensors")
        return unflatten_state(checkpoint.optimizer_structure, everything)["by_name"]

    def resume():
        state = resume_new() if kind == "resume-new" else resume_old()
        # read every moment, as the first optimizer step does: safetensors' `load_file` maps the file (copy on
        # write), so its tensors take memory only when they are read
        for one in state.values():
            for t in one.values():
                t.sum()
        return state

    state, growth = _growth(resume)
    moments = sum(t.nbytes for one in state.values() for t in one.values())
    return {"growth": growth, "state": moments}


def run(workdir: Path, settings: dict) -> dict:
    from spes_node.config import load_preset
    from spes_node.daemon.plan import HOST_RUNTIME, memory_plan

    preset = settings["preset"]
    plan = memory_plan(load_preset(preset), 1)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"plan_startup_bytes": plan.host_startup - HOST_RUNTIME}
    with LoadMonitor() as load, tempfile.TemporaryDirectory(dir=workdir) as directory:
        for kind in settings["phases"]:
            spec = json.dumps({"kind": kind, "preset": preset, "directory": directory})
            started = time.monotonic()
            out = subprocess.run(
                python_cmd("benchmarks.startup_memory", "--probe", spec),
                check=True,
                capture_output=True,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS=str(settings["torch_threads"])),
            )
            results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
            results[kind]["seconds"] = round(time.monotonic() - started, 1)
            emit(f"{kind}: {results[kind]}")
    rows = []
    for kind, what in (
        ("make", "making the model"),
        ("resume", "resuming a checkpoint"),
        ("init", "--init-from a HF checkpoint"),
    ):
        new, old = results.get(f"{kind}-new"), results.get(f"{kind}-old")
        if new or old:
            state = (new or old)["state"]
            beyond = [mib(r["growth"] - r["state"]) if r else "-" for r in (new, old)]
            rows.append([what, mib(state), *beyond])
    written = f"checkpoint {mib(results['write']['bytes']):.0f} MiB; " if "write" in results else ""
    emit(
        table(
            ["phase", "own state MiB", "beyond it MiB (now)", "beyond it MiB (before)"],
            rows,
            title=f"startup host memory ({preset}, 1 shard held, peak RSS growth; "
            f"{written}plan: {mib(results['plan_startup_bytes']):.0f} MiB)",
        )
    )
    write_result(f"startup_memory_{preset}", settings, results, load.summary())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", help="internal: one measure (JSON), printed as JSON")
    parser.add_argument("--preset", default=SETTINGS["preset"])
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated, in order (a resume needs `write` first); spes-7b fits this machine only as made now",
    )
    parser.add_argument("--workdir", default="runs/benchmarks/startup_memory")
    args = parser.parse_args()
    if args.probe:
        emit(json.dumps(probe(**json.loads(args.probe))))
        return
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"--phases: unknown {sorted(unknown)}; choose from {', '.join(PHASES)}")
    run(Path(args.workdir), dict(SETTINGS, preset=args.preset, phases=phases))


if __name__ == "__main__":
    main()

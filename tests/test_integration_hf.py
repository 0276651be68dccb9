"""The HuggingFace Trainer on zerotrain through ``zerotrain.compat.deepspeed.activate()``.

The Trainer runs with HF's own ZeRO-2 and ZeRO-3 template configs ("auto" values, offload to
the CPU) on 2 gloo ranks, a tiny GPT-2 built from a config. A forward hook records the batches
the Trainer fed and the losses it got; the same batches through zerotrain called directly, with
the config the Trainer filled in, must give the same losses and parameters. Then: evaluation,
``save_model``, a resume from a checkpoint that continues exactly, and ``generate`` at ZeRO-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

# find_spec, not importorskip: importing accelerate before activate() would fix its view of
# deepspeed for the process (the spawned ranks import this module first)
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")),
    reason="needs transformers and accelerate",
)

ROOT = Path(__file__).resolve().parents[1]

# The keys of HF's documented ZeRO-2 and ZeRO-3 templates (docs: "DeepSpeed" in transformers).
HF_OPTIMIZER = {
    "type": "AdamW",
    "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")},
}
HF_SCHEDULER = {
    "type": "WarmupLR",
    "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")},
}
HF_COMMON = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": HF_OPTIMIZER,
    "scheduler": HF_SCHEDULER,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO = {
    2: {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    3: {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
VOCAB, SEQ, MICRO, ACCUM, STEPS = 64, 16, 2, 2, 4


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout: the runs compared draw from different generators
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


class _Recorder:
    """A forward hook: the batches a training run fed the model (with the Trainer's token count
    of the whole accumulated global batch), and the losses it got."""

    def __init__(self, model):
        self.batches: list[tuple[torch.Tensor, int]] = []
        self.losses: list[float] = []
        model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output) -> None:
        if module.training:
            items = int(kwargs["num_items_in_batch"])
            self.batches.append((kwargs["input_ids"].detach().clone(), items))
            self.losses.append(output.loss.item())


def _trainer(stage: int, out: str, max_steps: int = STEPS):
    from transformers import Trainer, TrainingArguments

    model = _model()
    recorder = _Recorder(model)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=max_steps,
        learning_rate=1e-2,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=2,
        report_to=[],
        deepspeed={**HF_COMMON, "zero_optimization": HF_ZERO[stage]},
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), eval_dataset=_Tokens())
    return trainer, recorder


def _direct(config: dict, batches: list[tuple[torch.Tensor, int]]) -> tuple[list[float], dict]:
    """The same micro-batches through zerotrain called directly, with the Trainer's loss:
    the token-weighted mean over the accumulated global batch (a sum over this micro-batch's
    tokens divided by the global count, times the ranks), not divided again by the
    accumulation steps."""
    import zerotrain

    engine, *_ = zerotrain.initialize(model=_model(), config=config)
    losses = []
    for ids, items in batches:
        loss = engine(input_ids=ids, labels=ids, num_items_in_batch=items).loss
        engine.backward(loss * engine.comm.world_size, scale_wrt_gas=False)
        engine.step()
        losses.append(loss.item())
    return losses, engine.consolidated_state_dict()


def train_with_hf_trainer(stage: int, root: str) -> dict:
    from zerotrain.compat.deepspeed import activate

    activate()
    from zerotrain import ZeroTrainEngine

    trainer, recorder = _trainer(stage, f"{root}/run")
    trainer.train()
    engine = trainer.model_wrapped
    assert isinstance(engine, ZeroTrainEngine), type(engine)
    config = trainer.args.hf_deepspeed_config.config  # the "auto" values filled in
    trained = engine.consolidated_state_dict()
    evaluation = trainer.evaluate()
    trainer.save_model(f"{root}/final")
    # ZeRO-3: generate gathers each block as it runs
    prompt = torch.tensor([[1, 2, 3]])
    generated = trainer.model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    direct_losses, direct_state = _direct(config, recorder.batches)
    # resume from the step-2 checkpoint: steps 3-4 as in the straight run
    resumed, resumed_recorder = _trainer(stage, f"{root}/run")
    resumed.train(resume_from_checkpoint=f"{root}/run/checkpoint-2")
    return {
        "losses": recorder.losses,
        "direct_losses": direct_losses,
        "state_equal": all(torch.equal(trained[k], direct_state[k]) for k in trained),
        "resumed_losses": resumed_recorder.losses,
        "resumed_equal": all(
            torch.equal(v, resumed.model_wrapped.consolidated_state_dict()[k])
            for k, v in trained.items()
        ),
        "eval_loss": evaluation["eval_loss"],
        "generated": generated.tolist(),
        "clipping": config["gradient_clipping"],
        "trained": trained,
        "first_batch": recorder.batches[0][0],
    }


# stage 2 with the slow tests (47 s on loaded cores): stage 3 runs the same path and more
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_hf_trainer_trains_as_zerotrain_called_directly(tmp_path, stage):
    from transformers import GPT2LMHeadModel

    results = run_distributed(
        train_with_hf_trainer, 2, stage, str(tmp_path), timeout=400, fresh_interpreter=True
    )
    for rank in results:
        assert rank["clipping"] == 1.0
        assert len(rank["losses"]) == STEPS * ACCUM
        assert rank["losses"] == pytest.approx(rank["direct_losses"], rel=1e-6, abs=0)
        assert rank["state_equal"]
        assert rank["resumed_losses"] == rank["losses"][2 * ACCUM :]
        assert rank["resumed_equal"]
        assert torch.isfinite(torch.tensor(rank["eval_loss"]))
    assert not torch.equal(results[0]["first_batch"], results[1]["first_batch"])  # sharded
    assert results[0]["generated"] == results[1]["generated"]
    assert len(results[0]["generated"][0]) == 3 + 4
    # save_model wrote a plain HF model whose weights are the trained ones
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "final").state_dict()
    trained = results[0]["trained"]
    assert set(trained) <= set(saved)
    for key, value in trained.items():
        assert torch.equal(saved[key], value), key
    # the Trainer's checkpoint-N folder (its model.safetensors beside latest and global_step4/)
    # is a checkpoint to every tool: HF's documented recovery path, and inspect
    from zerotrain.checkpoint import inspect_checkpoints
    from zerotrain.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    folder = tmp_path / "run" / "checkpoint-4"
    assert {"model.safetensors", "latest", "global_step4"} <= {p.name for p in folder.iterdir()}
    recovered = load_state_dict_from_zero_checkpoint(_model(), folder).state_dict()
    for key, value in trained.items():
        assert torch.equal(recovered[key], value), key
    assert "global_step4: complete" in inspect_checkpoints(folder)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
    )


def test_nothing_changes_without_activate():
    done = _python(
        """
        import importlib.metadata, importlib.util, sys
        import zerotrain, zerotrain.compat.deepspeed
        assert importlib.util.find_spec("deepspeed") is None
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            print("absent")
        """
    )
    assert done.stdout.strip() == "absent", done.stderr


def test_activate_aliases_modules_and_metadata_until_deactivated():
    done = _python(
        """
        import importlib.metadata, importlib.util
        from zerotrain.compat import deepspeed as compat
        compat.activate()
        compat.activate()  # idempotent
        import deepspeed, deepspeed.comm as dist, zerotrain
        from deepspeed.accelerator import get_accelerator
        assert deepspeed is zerotrain and dist is zerotrain.comm
        assert importlib.metadata.version("deepspeed") == "0.19.8+zerotrain"
        assert importlib.util.find_spec("deepspeed.no_such_module") is None
        compat.deactivate()
        assert importlib.util.find_spec("deepspeed") is None
        print("ok")
        """,
        RANK="0",
    )
    assert done.stdout.splitlines() == [
        "zerotrain: `import deepspeed` is zerotrain 0.1.0 in this process (distribution "
        "deepspeed 0.19.8+zerotrain); DeepSpeed itself is not used",
        "ok",
    ], done.stderr


def test_activate_refuses_next_to_a_real_deepspeed_unless_shadowing(tmp_path):
    # a stand-in for an installed DeepSpeed: a package and its distribution metadata
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    info = tmp_path / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    code = """
        from zerotrain.compat import deepspeed as compat
        try:
            compat.activate()
        except compat.DeepSpeedInstalled as error:
            print("refused:", error)
        compat.activate(shadow=True, announce=False)
        import deepspeed, zerotrain
        print("shadowed:", deepspeed is zerotrain)
        """
    done = _python(code, PYTHONPATH=f"{ROOT}:{tmp_path}")
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "refused: zerotrain.compat.deepspeed.activate(): DeepSpeed is "
        "installed here (deepspeed 0.19.8"
    ), done.stderr
    assert "Pass shadow=True" in lines[0]
    assert lines[1] == "shadowed: True"
    # once a real deepspeed module is imported, even shadow=True refuses
    late = _python(
        """
        import deepspeed
        from zerotrain.compat import deepspeed as compat
        try:
            compat.activate(shadow=True)
        except compat.DeepSpeedInstalled as error:
            print("refused:", error)
        """,
        PYTHONPATH=f"{ROOT}:{tmp_path}",
    )
    assert "is imported already" in late.stdout, late.stderr
    assert importlib.util.find_spec("deepspeed") is None  # this process untouched


def test_activate_refuses_after_accelerate_was_imported_without_deepspeed():
    done = _python(
        """
        import accelerate.utils
        from zerotrain.compat import deepspeed as compat
        try:
            compat.activate()
        except compat.DeepSpeedInstalled as error:
            print("refused:", error)
        print("active:", compat.active())
        """
    )
    assert done.stdout.splitlines() == [
        "refused: zerotrain.compat.deepspeed.activate(): accelerate was imported before it, "
        "when `import deepspeed` failed, and keeps no DeepSpeed support in this process; call "
        "activate() before importing accelerate or transformers (as `zerotrain run "
        "--deepspeed-compat` does)",
        "active: False",
    ], done.stderr


TRAINER_SCRIPT = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import deepspeed

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
data = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32}] * 8
ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
      "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}}
args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=2,
                         report_to=[], use_cpu=True, deepspeed=ds, save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
# one string, one write: the ranks share stdout, and print writes each argument apart
print(f"engine: {type(trainer.model_wrapped).__module__} {deepspeed.__version__}", flush=True)
"""


def test_zerotrain_run_deepspeed_compat_runs_an_unchanged_trainer_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotrain.cli",
            "run",
            "--deepspeed-compat",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert done.stdout.count("zerotrain.engine 0.1.0") == 2, done.stdout[-2000:]  # per rank
    announced = [line for line in lines if "is zerotrain 0.1.0 in this process" in line]
    assert len(announced) == 1  # rank 0 only


PEFT_TRAINER_SCRIPT = """
import json
import sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out, resume = sys.argv[1], len(sys.argv) > 2
torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                    resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
lora = LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
model = get_peft_model(GPT2LMHeadModel(config), lora)
ids = [torch.arange(16) * (i % 3 + 1) % 64 for i in range(32)]
data = [{"input_ids": x, "labels": x} for x in ids]
ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
      "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
args = TrainingArguments(output_dir=out, max_steps=8, per_device_train_batch_size=2,
                         learning_rate=1e-2, report_to=[], use_cpu=True, deepspeed=ds,
                         save_strategy="steps", save_steps=4, logging_steps=1,
                         disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train(resume_from_checkpoint=f"{out}/checkpoint-4" if resume else None)
if trainer.args.process_index == 0:
    print("losses", json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]))
    base = trainer.model_wrapped.module.base_model.model.transformer.h[0].mlp.c_fc.base_layer
    print(f"base held {base.weight.numel()} of {base.weight.ds_numel}")
"""


@pytest.mark.slow  # 80 s on loaded cores; test_lora trains peft at every stage by default
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_hf_trainer_fine_tunes_peft_lora_at_zero3_and_resumes(tmp_path):
    """The commonest ZeRO-3 job: HF's Trainer, a peft model, the frozen base partitioned. The
    Trainer saves peft checkpoints without the frozen base (exclude_frozen_parameters); resuming
    from step 4 repeats steps 5-8 exactly."""
    script = tmp_path / "train.py"
    script.write_text(PEFT_TRAINER_SCRIPT)

    def run(*args: str) -> str:
        command = [sys.executable, "-m", "zerotrain.cli", "run", "--deepspeed-compat"]
        done = subprocess.run(
            [*command, "--nproc-per-node", "2", str(script), str(tmp_path / "out"), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def losses(stdout: str) -> list[float]:
        (line,) = [line for line in stdout.splitlines() if line.startswith("losses ")]
        return json.loads(line.removeprefix("losses "))

    straight, resumed = run(), run("resume")
    assert "base held 0 of 4096" in straight  # a placeholder between uses: partitioned
    # the resumed run's history holds steps 1-4 from the checkpoint, 5-8 computed again
    assert len(losses(straight)) == 8 and losses(resumed) == losses(straight), resumed


@pytest.mark.slow  # the documented --use_deepspeed command below covers the same ranks
def test_accelerate_launch_runs_ranks_through_the_compat_runner(tmp_path):
    """`accelerate launch --module zerotrain.compat script.py`: each rank activates the alias
    before the script runs (`--use_deepspeed` would need DeepSpeed in the launcher itself)."""
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    launch += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launch += ["--dynamo_backend", "no", "--main_process_port", "0"]
    done = subprocess.run(
        [*launch, "--module", "zerotrain.compat", str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("engine: zerotrain.engine 0.1.0") == 2, done.stdout  # per rank
    assert done.stdout.count("is zerotrain 0.1.0 in this process") == 1  # rank 0 announces


ACCELERATE_SCRIPT = """
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
import deepspeed

# gloo: Accelerate picks a backend only for accelerators (see docs/integrations.md)
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(2):
    accelerator.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
stage = model.zero_optimization_stage()
print(f"engine: {type(model).__module__} {deepspeed.__version__} stage {stage}", flush=True)
"""


def test_accelerate_launch_use_deepspeed_runs_on_zerotrain(tmp_path):
    """`python -m zerotrain.compat accelerate launch --use_deepspeed ... --module
    zerotrain.compat script.py`: Accelerate's launcher finds `deepspeed.launcher.runner` and
    starts the ranks with its DeepSpeed environment, each through the compat runner."""
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SCRIPT)
    accelerate = Path(sys.executable).with_name("accelerate")
    launch = [sys.executable, "-m", "zerotrain.compat", str(accelerate), "launch"]
    launch += ["--use_deepspeed", "--zero_stage", "2", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", "0", "--module", "zerotrain.compat", str(script)]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("engine: zerotrain.engine 0.1.0 stage 2") == 2, done.stdout


def _accelerate_run(stage: int, root: str) -> dict:
    """Accelerate with a DeepSpeed plugin and the tiny GPT-2: 4 steps saving its state after
    the second, then the state loaded into a new run that repeats steps 3-4; and zerotrain
    called directly on the batches the first run drew."""
    # What `accelerate launch --use_deepspeed` sets; and gloo, since Accelerate picks a
    # backend only for accelerators (its CPU path turns DeepSpeed off): test-side workarounds
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from zerotrain.compat.deepspeed import activate

    activate(announce=False)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    import zerotrain

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,  # for get_state_dict
        },
        "steps_per_print": 10**6,
    }
    samples = [_Tokens()[i]["input_ids"] for i in range(16)]
    model = _model  # the tiny GPT-2

    def adamw(module):
        return torch.optim.AdamW(module.parameters(), lr=1e-2)

    def run(load: str | None = None):
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(config)),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        )
        fresh = model()
        engine, optimizer, data = accelerator.prepare(
            fresh, adamw(fresh), torch.utils.data.DataLoader(samples, batch_size=2)
        )
        if load:
            accelerator.load_state(load)
        batches, losses = [], []
        for step, ids in enumerate(data):
            if load and step < 2:
                continue
            loss = engine(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches.append(ids)
            losses.append(loss.item())
            if step == 1 and not load:
                accelerator.save_state(f"{root}/state")
        return accelerator, engine, batches, losses

    accelerator, engine, batches, losses = run()
    full = accelerator.get_state_dict(engine)  # stage 3: rank 0 has the model, others None
    unwrapped = accelerator.unwrap_model(engine)
    consolidated = engine.consolidated_state_dict()
    _, resumed, _, resumed_losses = run(load=f"{root}/state")
    fresh = model()
    direct, *_ = zerotrain.initialize(model=fresh, optimizer=adamw(fresh), config=config)
    direct_losses = []
    for ids in batches:
        loss = direct(input_ids=ids, labels=ids).loss
        direct.backward(loss)
        direct.step()
        direct_losses.append(loss.item())
    return {
        "engine": type(engine).__name__,
        "unwrapped": type(unwrapped).__name__,
        "losses": losses,
        "direct_losses": direct_losses,
        "direct_equal": all(
            torch.equal(v, direct.consolidated_state_dict()[k]) for k, v in consolidated.items()
        ),
        "resumed_losses": resumed_losses,
        "resumed_equal": all(
            torch.equal(v, resumed.consolidated_state_dict()[k]) for k, v in consolidated.items()
        ),
        "full_equal": full is not None
        and all(torch.equal(full[k].float(), v) for k, v in consolidated.items()),
        "full_none": full is None,
    }


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_accelerate_trains_saves_and_loads_state_on_zerotrain(tmp_path, stage):
    results = run_distributed(
        _accelerate_run, 2, stage, str(tmp_path), timeout=300, fresh_interpreter=True
    )
    for rank, got in enumerate(results):
        assert got["engine"] == "ZeroTrainEngine" and got["unwrapped"] == "GPT2LMHeadModel"
        assert len(got["losses"]) == 4  # 16 samples, 2 ranks, batches of 2
        assert got["losses"] == pytest.approx(got["direct_losses"], rel=1e-6, abs=0)
        assert got["direct_equal"]
        assert got["resumed_losses"] == got["losses"][2:]
        assert got["resumed_equal"]
        assert got["full_equal"] if rank == 0 or stage < 3 else got["full_none"]
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own shard of the data


def test_accelerate_dummy_scheduler_defaults_run_deepspeeds_warmup_schedules():
    """Accelerate's DummyScheduler defaults to warmup_num_steps=0, which DeepSpeed 0.19.6 and
    later refuse (as zerotrain does); accelerator.prepare fills in max(1, 0), and the schedule
    warms up over DeepSpeed's minimum of 2 steps: warmup_min_lr at the first step, then
    warmup_max_lr (WarmupDecayLR then decays linearly to 0 at total_num_steps)."""
    done = _python(
        """
        import os, socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        from zerotrain.compat.deepspeed import activate
        activate(announce=False)
        import torch
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import (DeepSpeedPlugin, DummyOptim, DummyScheduler,
                                      InitProcessGroupKwargs)
        for kind in ("WarmupLR", "WarmupDecayLR"):
            AcceleratorState._reset_state(True)
            PartialState._reset_state()
            params = {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")}
            if kind == "WarmupDecayLR":
                params["total_num_steps"] = "auto"
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                "scheduler": {"type": kind, "params": params},
            }
            accelerator = Accelerator(
                deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
            )
            model = torch.nn.Linear(4, 4)
            optimizer = DummyOptim(model.parameters(), lr=1e-2)
            scheduler = DummyScheduler(optimizer, total_num_steps=4)  # warmup_num_steps=0
            engine, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
            lrs = []
            for _ in range(4):
                accelerator.backward(engine(torch.randn(2, 4)).square().mean())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                lrs.append(round(scheduler.get_last_lr()[0], 12))
            filled = accelerator.deepspeed_config["scheduler"]["params"]["warmup_num_steps"]
            print(kind, filled, lrs)
        """
    )
    assert done.stdout.splitlines()[-2:] == [
        "WarmupLR 1 [0.0, 0.01, 0.01, 0.01]",
        "WarmupDecayLR 1 [0.0, 0.01, 0.01, 0.005]",
    ], done.stderr[-3000:]

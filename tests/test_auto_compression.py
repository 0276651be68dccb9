"""comm_compression.auto: the link model and its probe, the dry run's bytes against the real
collectives', the prediction, and the tuner's decisions in training (switch, keep, revert,
resume), on 2 ranks over gloo."""

from __future__ import annotations

import re
import time
import warnings

import pytest
import torch
from distributed import run_distributed
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.comm.link import Link, hops, probe_link
from zerotrain.compression import (
    BucketShape,
    GradientCompression,
    ParameterCompression,
    ParameterGather,
    make_codec,
)
from zerotrain.compression.auto import Cost, Policy, Traffic, policy_costs, predict
from zerotrain.config import ConfigError, load_config


def test_the_alpha_beta_model():
    link = Link(alpha=1e-5, beta=1e8)
    assert hops("all_reduce", 4) == 6 and hops("all_gather", 4) == 3
    assert link.seconds("all_reduce", 10**6, 4) == pytest.approx(6e-5 + 1e-2)
    cost = Cost(0.5, [("all_reduce", 10**6, 2.0), ("all_to_all", 10**4, 1.0)])
    assert cost.sent == 2 * 10**6 + 10**4
    assert cost.seconds(link, 4) == pytest.approx(0.5 + 2 * (6e-5 + 1e-2) + 3e-5 + 1e-4)
    # a policy's prediction: the measured step, less the current policy's cost, plus its own
    cheaper = Cost(0.1, [("all_reduce", 10**5, 1.0)])
    assert predict(2.0, cost, cost, link, 4) == pytest.approx(2.0)
    assert predict(2.0, cost, cheaper, link, 4) == pytest.approx(
        2.0 - cost.seconds(link, 4) + 0.1 + 6e-5 + 1e-3
    )


def test_config_of_auto():
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
    cfg = load_config({**base, "comm_compression": {"auto": True}}, world_size=1)
    assert cfg.comm_compression.auto and cfg.comm_compression.auto_recheck_steps == 1000
    onebit = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}}
    with pytest.raises(ConfigError, match="comm_compression.auto: optimizer.type OneBitAdam"):
        load_config({**base, "optimizer": onebit, "comm_compression": {"auto": True}}, world_size=1)
    zero_one = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "local_step_clipper": 16}}
    with pytest.raises(ConfigError, match="local_step_clipper: 16 asks 0/1 Adam for local"):
        load_config({**base, "optimizer": zero_one}, world_size=1)
    zero_one["params"]["local_step_clipper"] = 1
    with pytest.raises(ConfigError, match="optimizer.type: ZeroOneAdam compresses what each"):
        load_config(
            {**base, "optimizer": zero_one, "zero_optimization": {"stage": 3}}, world_size=1
        )


# -- the dry run sends what the collectives send; the probe -----------------------------------------
SHAPES = [
    BucketShape(1200 + 16 + 8, [(0, (40, 30)), (1200, (16,))]),
    BucketShape(2048, [(0, (64, 32))]),
]
GRADIENTS = [
    None,
    GradientCompression(method="powersgd", rank=4),
    GradientCompression(method="acp_sgd", rank=4),
    GradientCompression(method="topk", ratio=0.05),
    GradientCompression(method="gtopk", ratio=0.05),
    GradientCompression(method="int8", block_size=64),
    GradientCompression(method="int4", block_size=64),
]
PARAMETERS = [None, ParameterCompression(method="int8", block_size=64)]


def dry_run_checks() -> dict:
    """For each policy and collective: the bytes the real codec and gather sent, and those the
    dry run counted; the probed link."""
    comm = Communicator()
    out: dict = {"link": probe_link(comm)}
    gen = torch.Generator().manual_seed(comm.rank)
    # the last: bucket 0 reduced in bf16 (torch_autocast's safe modules), bucket 1 in fp32
    for collective, dtype, own in (
        ("all_reduce", torch.float32, {}),
        ("reduce_scatter", torch.float32, {}),
        ("reduce_scatter", torch.bfloat16, {}),
        ("reduce_scatter", torch.float32, {0: torch.bfloat16}),
    ):
        for gradients in GRADIENTS:
            for parameters in PARAMETERS:
                policy = Policy(gradients, parameters)
                # even counts: ACP-SGD sends P and Q in turn
                reductions, gathers = {0: 2.0, 1: 4.0}, {300: 1.0, 1024: 3.0}
                traffic = Traffic(collective, reductions, gathers, dtype, dtype, own)
                codec = make_codec(gradients, comm, SHAPES)
                gather = ParameterGather(comm, parameters)
                comm.reset_stats()
                for index, times in traffic.reductions.items():
                    for _ in range(int(times)):
                        wire = own.get(index, dtype)
                        flat = torch.randn(SHAPES[index].numel_padded, generator=gen).to(wire)
                        if collective == "all_reduce":
                            codec.all_reduce(index, flat).wait()
                        else:
                            shard = flat.new_empty(flat.numel() // 2)
                            codec.reduce_scatter(index, shard, flat).wait()
                for numel, times in traffic.gathers.items():
                    for _ in range(int(times)):
                        piece = torch.randn(numel, generator=gen).to(dtype)
                        gather.all_gather(piece.new_empty(2 * numel), piece).wait()
                real = sum(s.sent for s in comm.stats.values())
                (cost,) = policy_costs((policy,), traffic, comm, SHAPES)
                out[collective, dtype, bool(own), policy.name] = (real, cost.sent, cost.compute)
    return out


@pytest.fixture(scope="module")
def dry_runs() -> list[dict]:
    return run_distributed(dry_run_checks, 2)


def test_the_dry_run_counts_the_bytes_the_collectives_send(dry_runs):
    for rank_out in dry_runs:
        policies = [k for k in rank_out if k != "link"]
        assert len(policies) == 4 * len(GRADIENTS) * len(PARAMETERS)
        for key in policies:
            real, counted, compute = rank_out[key]
            assert counted == real > 0, key
            assert compute >= 0
    # compression sends fewer bytes than the backend's collectives
    out = dry_runs[0]
    fp32, bf16 = torch.float32, torch.bfloat16
    for collective in ("all_reduce", "reduce_scatter"):
        plain = out[collective, fp32, False, "uncompressed"][1]
        for name in ("powersgd", "int8", "int4 + int8 params"):
            assert out[collective, fp32, False, name][1] < plain, (collective, name)
    # a 16-bit wire: half the uncompressed bytes; the quantized codes the same
    half = out["reduce_scatter", bf16, False, "uncompressed"][1]
    assert half == out["reduce_scatter", fp32, False, "uncompressed"][1] / 2
    int8 = "int8 + int8 params"
    assert (
        out["reduce_scatter", bf16, False, int8][1] == out["reduce_scatter", fp32, False, int8][1]
    )
    # one bucket on a 16-bit wire: between the two
    mixed = out["reduce_scatter", fp32, True, "uncompressed"][1]
    assert half < mixed < 2 * half


def test_the_probe_measures_one_link_for_every_rank(dry_runs):
    links = [out["link"] for out in dry_runs]
    assert links[0] == links[1]  # the slowest rank's times, on both
    assert 0 < links[0].beta < float("inf") and links[0].alpha >= 0


def test_large_buckets_are_costed_in_pieces_with_the_same_bytes(monkeypatch):
    """Costing holds one piece of a bucket at a time; the bytes come out as for the whole
    bucket (quantization: up to its blocks' rounding)."""
    from zerotrain.compression import auto

    comm = Communicator()
    comm.world_size = 2  # a stand-in: the dry run only reads the rank and the world size
    shapes = [BucketShape(3264, [(0, (40, 30)), (1200, (16,)), (1216, (64, 32))])]
    traffic = Traffic("reduce_scatter", {0: 1.0}, {1632: 1.0})
    policies = (
        Policy(),
        Policy(GradientCompression(method="powersgd", rank=4, min_numel=0)),
        Policy(GradientCompression(method="int8"), ParameterCompression(method="int8")),
    )
    whole = policy_costs(policies, traffic, comm, shapes)
    monkeypatch.setattr(auto, "DRY_RUN_NUMEL", 1000)
    assert len(auto._pieces(shapes[0], 2)) == 3
    pieces = policy_costs(policies, traffic, comm, shapes)
    assert pieces[0].sent == whole[0].sent and pieces[1].sent == whole[1].sent
    assert pieces[2].sent == pytest.approx(whole[2].sent, rel=0.02)


# -- the tuner in training -------------------------------------------------------------------------
SLOW = Link(alpha=1e-4, beta=1e5)  # 0.8 Mb/s: every policy that sends less pays
FAST = Link(alpha=0.0, beta=1e15)  # the wire is free: the codecs' own compute decides


def auto_engine(stage: int, comm_compression: dict, recheck: int = 0, optimizer: str = "Adam"):
    import zerotrain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 48), nn.GELU(), nn.Linear(48, 40))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": None,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "comm_compression": {"auto": True, "auto_recheck_steps": recheck, **comm_compression},
    }
    return zerotrain.initialize(model=model, config=config)[0]


class SimulatedClock:
    """The tuner's clock: each step lasts what ``seconds`` gives the policy in use."""

    def __init__(self, tuner, seconds: dict[str, float]):
        self.tuner, self.seconds, self.now = tuner, seconds, 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += self.seconds[self.tuner.policy.name]


def train(engine, steps: int, gen: torch.Generator, clock: SimulatedClock | None = None):
    losses = []
    for _ in range(steps):
        if clock is not None:
            clock.advance()
        loss = engine(torch.randn(2, 40, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def resumed(tmp: str, tag: str, section: dict, seconds: dict, saved_at: int, then: int) -> dict:
    """On a slow link: ``saved_at`` steps, a checkpoint, then ``then`` steps, and the same
    ``then`` steps after loading it into a new engine: each one's losses and decisions."""
    rank = Communicator().rank
    gen = torch.Generator().manual_seed(rank)
    runs = {}
    for run in ("straight", "resumed"):
        engine = auto_engine(1, section)
        tuner = engine.optimizer.group.extensions["auto"]
        clock = SimulatedClock(tuner, seconds)
        tuner.clock, tuner.probe = clock, lambda comm: SLOW
        if run == "straight":
            train(engine, saved_at, gen, clock)
            engine.save_checkpoint(tmp, tag=tag)
            state = gen.get_state()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no codec state dropped
                engine.load_checkpoint(tmp, tag=tag)
            gen.set_state(state)
        decided = len(tuner.decisions)
        runs[run] = {
            "losses": train(engine, then, gen, clock),
            "decisions": [(d.step, d.outcome, d.policy) for d in tuner.decisions[decided:]],
            "policy": tuner.policy.name,
            "codec": engine.optimizer.group.reduction.codec.method,
        }
    return runs


def tuner_runs(tmp: str) -> dict:
    rank = Communicator().rank
    out: dict = {}
    scenarios = [  # (stage, section, the links probed in turn, a compressed step's seconds)
        ("slow s1 confirmed", 1, {}, [SLOW], 0.5),
        ("slow s1 reverted", 1, {}, [SLOW], 1.5),
        ("fast s1", 1, {}, [FAST], 0.5),
        ("slow s0", 0, {}, [SLOW], 0.5),
        ("slow s3", 3, {}, [SLOW], 0.5),
        ("slow s2 int4", 2, {"gradients": {"method": "int4"}}, [SLOW], 0.5),
        ("fast, then slow", 1, {}, [FAST, SLOW], 0.5),  # rechecked every 6 steps
    ]
    for name, stage, section, links, compressed in scenarios:
        recheck = 6 if len(links) > 1 else 0
        engine = auto_engine(stage, section, recheck)
        tuner = engine.optimizer.group.extensions["auto"]
        seconds = {p: 1.0 if p == "uncompressed" else compressed for p in tuner.policy_names}
        clock = SimulatedClock(tuner, seconds)
        probed = iter(links)
        tuner.clock, tuner.probe = clock, lambda comm, probed=probed: next(probed)
        engine.optimizer.comm.reset_stats()
        losses = train(
            engine, 16 if recheck == 0 else 20, torch.Generator().manual_seed(rank), clock
        )
        out[name] = {
            "decisions": [(d.step, d.outcome, d.policy) for d in tuner.decisions],
            "predicted": tuner.decisions[0].predicted,
            "policies": tuner.policy_names,
            "codec": engine.optimizer.group.reduction.codec.method,
            "ops": sorted(engine.optimizer.comm.stats),
            "losses": losses,
            "line": tuner.decisions[0].line(2),
        }
    # resume: the chosen policy, its codec's state and the tuner's schedule come back
    powersgd = {"gradients": {"method": "powersgd", "rank": 2}}
    seconds = {"uncompressed": 1.0, "powersgd": 0.5}
    out["resumed"] = resumed(tmp, "chosen", powersgd, seconds, 9, 3)
    int8 = {"parameters": {"method": "int8"}}  # the gathers at the load quantize too
    out["resumed int8"] = resumed(
        tmp, "int8", int8, {"uncompressed": 1.0, "int8 params": 0.5}, 9, 3
    )
    out["resumed undecided"] = resumed(tmp, "undecided", powersgd, seconds, 3, 12)
    slower = {"uncompressed": 1.0, "powersgd": 1.5}
    out["resumed unchecked"] = resumed(tmp, "unchecked", powersgd, slower, 8, 10)
    # top-k chosen: its codec counts each arrival's steps for an Adam, which catches up on
    # them, and not for SGD, which takes the sparse gradients as they come
    out["counts arrivals"] = {}
    for optimizer in ("Adam", "SGD"):
        engine = auto_engine(1, {"gradients": {"method": "topk"}}, optimizer=optimizer)
        tuner = engine.optimizer.group.extensions["auto"]
        tuner.use(next(p for p in tuner.options.policies if p.name == "topk"))
        out["counts arrivals"][optimizer] = engine.optimizer.group.reduction.codec.counting
    # the real clock and probe on this machine's loopback: a decision with its numbers
    engine = auto_engine(1, {})
    train(engine, 8, torch.Generator().manual_seed(rank))
    decision = engine.optimizer.group.extensions["auto"].decisions[0]
    out["real"] = (decision.step, decision.link, decision.predicted, decision.sent)
    return out


# auto's candidates at stages 1-3 with nothing configured
POLICIES = ["uncompressed", "int8", "int8 params", "int8 + int8 params"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> list[dict]:
    return run_distributed(tuner_runs, 2, str(tmp_path_factory.mktemp("auto")))


def test_every_rank_decides_alike(tuned):
    for name in tuned[0]:
        if not name.startswith("resumed") and name not in ("real", "counts arrivals"):
            assert tuned[0][name]["decisions"] == tuned[1][name]["decisions"], name


def test_a_slow_link_switches_to_compression_and_the_measurement_confirms_it(tuned):
    """Uncompressed for 6 steps (5 measured), then the prediction; the switch is measured for
    5 steps after the first and confirmed."""
    run = tuned[0]["slow s1 confirmed"]
    assert run["policies"] == POLICIES
    assert run["decisions"] == [
        (6, "chose", "int8 + int8 params"),
        (12, "confirmed", "int8 + int8 params"),
    ]
    predicted = run["predicted"]
    assert predicted["uncompressed"] == pytest.approx(1.0)
    assert min(predicted, key=predicted.get) == "int8 + int8 params"
    assert run["codec"] == "int8"
    assert {"int8_reduce_scatter", "int8_param_all_gather"} <= set(run["ops"])
    assert all(torch.isfinite(torch.tensor(run["losses"])))
    assert "link 100 us per hop, 0.8 Mb/s" in run["line"]
    assert re.search(r"chose int8 \+ int8 params \(decided in \d+\.\d\d s\)$", run["line"])


def test_a_switch_measured_slower_is_reverted(tuned):
    run = tuned[0]["slow s1 reverted"]
    assert run["decisions"] == [
        (6, "chose", "int8 + int8 params"),
        (12, "reverted to", "uncompressed"),
    ]
    assert run["codec"] == "none"


def test_a_free_wire_keeps_uncompressed(tuned):
    run = tuned[0]["fast s1"]
    assert run["decisions"] == [(6, "kept", "uncompressed")]
    assert run["codec"] == "none"
    assert not {"int8_param_all_gather", "int8_reduce_scatter"} & set(run["ops"])
    # every compressed policy costs its own compute and saves nothing
    assert all(s >= run["predicted"]["uncompressed"] for s in run["predicted"].values())


def test_it_decides_again_every_recheck_steps(tuned):
    """Kept at step 6 on a free wire; 6 steps later the link is slow: switched, confirmed."""
    assert tuned[0]["fast, then slow"]["decisions"] == [
        (6, "kept", "uncompressed"),
        (12, "chose", "int8 + int8 params"),
        (18, "confirmed", "int8 + int8 params"),
    ]


def test_each_stage_chooses_among_its_policies(tuned):
    assert tuned[0]["slow s0"]["policies"] == ["uncompressed", "int8"]
    assert tuned[0]["slow s0"]["decisions"][0] == (6, "chose", "int8")
    s3 = tuned[0]["slow s3"]
    assert s3["policies"] == POLICIES
    assert s3["decisions"][0] == (6, "chose", "int8 + int8 params")
    assert s3["codec"] == "int8"
    configured = tuned[0]["slow s2 int4"]  # only what is configured: int4 gradients, or not
    assert configured["policies"] == ["uncompressed", "int4"]
    assert configured["decisions"][0] == (6, "chose", "int4")


def test_resume_continues_the_chosen_policy_bit_for_bit(tuned):
    """Saved after a switch, with gradient or parameter compression: the same steps as
    without the checkpoint (quantized parameter gathers from the load on)."""
    for out in tuned:
        for name, policy, codec in (
            ("resumed", "powersgd", "powersgd"),
            ("resumed int8", "int8 params", "none"),
        ):
            straight, again = out[name]["straight"], out[name]["resumed"]
            assert (again["policy"], again["codec"]) == (policy, codec)
            assert again["losses"] == straight["losses"], name


def test_resume_continues_the_tuners_schedule(tuned):
    """Saved before the first decision, a resumed run still decides (auto_recheck_steps 0
    once turned it off for good); saved between a switch and its check, it still checks and
    reverts a slower policy. It measures its own steps first, so it decides a few steps
    later than the run it resumed."""
    for out in tuned:
        undecided = out["resumed undecided"]
        assert undecided["straight"]["decisions"][0] == (6, "chose", "powersgd")
        step, outcome, policy = undecided["resumed"]["decisions"][0]
        assert step >= 6 and (outcome, policy) == ("chose", "powersgd")
        unchecked = out["resumed unchecked"]
        assert unchecked["straight"]["decisions"] == [(12, "reverted to", "uncompressed")]
        assert [d[1:] for d in unchecked["resumed"]["decisions"]] == [
            ("reverted to", "uncompressed")
        ]


def test_the_real_probe_and_clock_decide(tuned):
    step, link, predicted, sent = tuned[0]["real"]
    assert step == 6 and link.beta > 0
    assert set(predicted) == set(sent) == set(POLICIES)
    assert sent["int8 + int8 params"] < sent["uncompressed"]


def test_top_k_chosen_counts_arrivals_only_for_an_adam_that_catches_up(tuned):
    for run in tuned:
        assert run["counts arrivals"] == {"Adam": True, "SGD": False}


class _SlowLink:
    """A communicator of 2 ranks whose all-reduce takes 2 hops of 20 ms plus 1 MB/s for what
    a rank sends (its message, for 2 ranks): what it was asked to send, kept."""

    world_size, device = 2, torch.device("cpu")

    def __init__(self):
        self.messages: list[int] = []

    def all_reduce(self, tensor, op="sum", name="all_reduce"):
        nbytes = tensor.numel() * tensor.element_size()
        self.messages.append(nbytes)
        if tensor.numel() > 1:  # not the probe's exchange of its times
            time.sleep(2 * 0.02 + nbytes / 1e6)


def test_a_slow_link_is_probed_with_a_message_it_carries_in_a_quarter_second():
    # 4 MiB four times over 10 Mbit/s took 27 s of a 38 s job (bench/sites.py, auto rows)
    comm = _SlowLink()
    link = probe_link(comm)  # type: ignore[arg-type]
    # 64 KiB took 0.1 s, 256 KiB 0.3 s: each timed after an untimed run, the large one's
    # timed run the first of 3 (it was sent 6 times before, the growth's 2 and 4 more)
    assert max(comm.messages) == 256 << 10 and comm.messages.count(256 << 10) == 2 + 2
    assert comm.messages.count(64 << 10) == 2
    assert sum(comm.messages) < 1.3e6
    assert link.beta == pytest.approx(1e6, rel=0.15)
    assert link.alpha == pytest.approx(0.02, rel=0.3)

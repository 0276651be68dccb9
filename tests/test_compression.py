"""Communication compression (zerotrain/compression): the operators against their papers'
definitions, the codecs' limits that must be exact, error feedback's conservation, bytes, and
training through the engine at ZeRO stages 0-3."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.compression import BucketShape, GradientCompression, make_codec
from zerotrain.compression.codec import LowRankCodec, SparseCodec
from zerotrain.compression.lowrank import orthonormalize
from zerotrain.compression.quantize import (
    code_bytes,
    dequantize,
    num_blocks,
    piece_blocks,
    quantize,
    sign_compress,
    sign_decompress,
)
from zerotrain.compression.sparse import SAMPLE_STRIDE, merge, top_k, tree_indices
from zerotrain.config import ConfigError, load_config
from zerotrain.optim.onebit import OneBitAdam, ZeroOneAdam


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# -- operators, one process ----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantization_error_is_half_a_step_per_block(bits):
    levels = 127 if bits == 8 else 7
    x = torch.randn(1001) * torch.linspace(0.01, 10, 1001)  # blocks of very different scales
    back = dequantize(quantize(x, bits, 64), 64)
    for start in range(0, 1001, 64):
        block = slice(start, start + 64)
        step = x[block].abs().max() / levels
        assert (back[block] - x[block]).abs().max() <= step / 2 * (1 + 1e-6)
    # multiples of the block's step within the levels come back exactly (odd length: int4 pads)
    exact = torch.randint(-levels, levels + 1, (1001,)).float() * 0.125
    exact[::64] = levels * 0.125  # each block's largest magnitude sets its step to 0.125
    assert torch.equal(dequantize(quantize(exact, bits, 64), 64), exact)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_partial_last_block_quantizes_as_if_padded_with_zeros(bits):
    """The whole blocks are quantized in place and the last, partial one from a padded copy:
    the codes and scales of the tensor zero-padded to whole blocks, cut to its length; bf16
    input quantized as its fp32 values; dequantized into a bf16 output, rounded once."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)).bfloat16()
    padded = torch.cat([x.float(), torch.zeros(23)])  # 1024: 16 whole blocks of 64
    got, whole = quantize(x, bits, 64), quantize(padded, bits, 64)
    assert torch.equal(got.scales, whole.scales)
    if bits == 8:
        assert torch.equal(got.codes, whole.codes[:1001])
    else:  # 1001 codes, two to a byte: the last byte's high nibble is padding
        assert torch.equal(got.codes[:500], whole.codes[:500])
    back = dequantize(got, 64, torch.empty(1001, dtype=torch.bfloat16))
    assert torch.equal(back, dequantize(whole, 64)[:1001].bfloat16())


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_of_pieces_quantize_each_piece_as_a_tensor_of_its_own(bits):
    """Given its pieces' lengths, a tensor is quantized as each piece alone, bit for bit: no
    block spans two pieces. A LayerNorm gain (1.0) beside a matrix's rows (about 0.02) in one
    int4 block of 256 sets their step to 1/7 and zeroes them; in blocks of their own they
    keep their values (the zeroed rows were dead units, which 1-bit Adam moved far: [Note:
    quantized parameter all-gather] in zerotrain/compression/gather.py)."""
    gen = torch.Generator().manual_seed(0)
    pieces = [64, 3 * 64 + 5, 1, 300]  # a gain, rows of a matrix, a bias, another matrix
    x = torch.cat([torch.ones(64), torch.randn(sum(pieces) - 64, generator=gen) * 0.02])
    blocks = piece_blocks(pieces, 256, x.device)
    assert blocks.tolist() == [64, 197, 1, 256, 44]
    got = quantize(x, bits, 256, blocks)
    back = dequantize(got, 256, blocks=blocks)
    alone = torch.cat([dequantize(quantize(p, bits, 256), 256) for p in x.split(pieces)])
    assert torch.equal(back, alone)
    assert got.scales.numel() == 5
    rows = slice(64, 64 + 3 * 64)
    assert (back[rows].view(3, 64) != 0).any(dim=1).all()
    if bits == 4:  # in one block with the gain, every row of the matrix comes back as zeros
        assert (dequantize(quantize(x, bits, 256), 256)[rows] == 0).all()


def test_one_bit_keeps_signs_and_each_blocks_l2_norm():
    """1-bit Adam's compressor, per block of 4: each element's sign (zero as +) times its
    block's scale, the root mean square, so each block keeps its L2 norm (the last block, of
    1 element, too)."""
    x = torch.tensor([0.5, -3.0, 0.0, 2.0, -0.25, 1.0, 7.0, -1.0, 0.125])  # 9: 16 bits
    packed, scales = sign_compress(x, 4)
    assert packed.dtype == torch.uint8 and packed.numel() == 2 and scales.numel() == 3
    back = sign_decompress(packed, scales, 9, 4)
    assert torch.equal(back.sign(), torch.where(x >= 0, 1.0, -1.0))
    for block in (slice(0, 4), slice(4, 8), slice(8, 9)):
        assert back[block].norm().item() == pytest.approx(x[block].norm().item())
        assert len(back[block].abs().unique()) == 1


def test_top_k_of_a_long_vector_is_torchs_whichever_way_it_is_found():
    """Above 32k elements top_k chooses among the values over a threshold from a strided
    sample; where fewer than k pass (the sample hit only the largest values), the whole
    vector. Either way the positions of torch.topk's k largest, also with ties."""
    gen = torch.Generator().manual_seed(0)
    n = 200_003
    noisy = torch.randn(n, generator=gen) * torch.linspace(0.1, 3.0, n)
    sampled_high = torch.rand(n, generator=gen)
    sampled_high[::SAMPLE_STRIDE] += 10.0  # the sample sees only these: its threshold is theirs
    ties = torch.where(torch.rand(n, generator=gen) < 0.002, 1.0, 0.0)  # ~400 ones, then zeros
    for values in (noisy, sampled_high, ties):
        for ratio in (0.001, 0.01, 0.1, 0.25, 0.5):
            k = math.ceil(ratio * n)
            want = torch.topk(values.abs(), k).values
            chosen = top_k(values, k)
            assert len(chosen) == k and torch.equal(chosen, chosen.unique()), ratio
            assert torch.equal(values[chosen].abs().sort(descending=True).values, want), ratio
    assert torch.equal(top_k(noisy, n + 1), torch.arange(n))


def test_top_k_keeps_the_non_finite_values_the_sample_misses():
    """A NaN or an infinity among the top k reaches the other ranks, which then skip the step:
    the threshold's compare must not drop a NaN off the sampled positions."""
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    values[1], values[2] = float("nan"), float("-inf")  # off the stride of 127
    chosen = top_k(values, 1000).tolist()
    assert 1 in chosen and 2 in chosen


def test_top_k_and_the_merge_of_two_sparse_vectors():
    x = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2])
    assert top_k(x, 2).tolist() == [1, 3]
    a = (torch.tensor([0, 2, 5]), torch.tensor([1.0, -4.0, 2.0]))
    b = (torch.tensor([2, 3, 5]), torch.tensor([1.0, 0.5, 2.5]))
    # summed: {0: 1, 2: -3, 3: 0.5, 5: 4.5}; its 2 largest magnitudes
    indices, values = merge(a, b, 2)
    assert indices.tolist() == [2, 5] and values.tolist() == [-3.0, 4.5]


def matrices_codec(method: str, rank: int, shape=(12, 10)) -> LowRankCodec:
    bucket = BucketShape(math.prod(shape) + 3, [(0, shape), (math.prod(shape), (3,))])
    options = GradientCompression(method=method, rank=rank, min_numel=0)
    return LowRankCodec(Communicator(), [bucket], options)


def test_powersgd_is_one_step_of_subspace_iteration_with_warm_start_and_error_feedback():
    """Vogels et al. Algorithm 1 in one process: P = M Q, P^ = orth(P), Q = M^T P^, rebuilt
    P^ Q^T; Q starts the next step (orthonormalized first, which spans the same P); the error
    M - rebuilt joins the next gradient."""
    codec = matrices_codec("powersgd", 3)
    mat = codec.matrices[0][0]
    q0 = mat.q.clone()
    grads = [torch.randn(123) for _ in range(2)]
    q_prev, error = q0, torch.zeros(12, 10)
    for grad in grads:
        flat = grad.clone()
        codec.all_reduce(0, flat).wait()
        m = grad[:120].view(12, 10) + error
        p_hat = orthonormalize(m @ q_prev)
        q_prev = m.T @ p_hat
        rebuilt = p_hat @ q_prev.T
        error = m - rebuilt
        assert relative_error(flat[:120].view(12, 10), rebuilt) < 1e-6
        assert torch.equal(flat[120:], grad[120:])  # the vector travels whole
        assert relative_error(mat.error, error) < 1e-5


def test_acp_sgd_alternates_the_factor_it_sends():
    """Zhang, Shi et al.: odd steps rebuild P Q^T with P = M orth(Q), even steps orth(P) Q^T
    with Q = M^T orth(P), each factor reused from the step before."""
    codec = matrices_codec("acp_sgd", 3)
    mat = codec.matrices[0][0]
    p, q = mat.p.clone(), mat.q.clone()
    for step in range(3):
        grad = torch.randn(123)
        m = grad[:120].view(12, 10) + (mat.error if mat.error is not None else 0)
        flat = grad.clone()
        codec.all_reduce(0, flat).wait()
        if step % 2 == 0:
            q_hat = orthonormalize(q)
            p = m @ q_hat
            rebuilt = p @ q_hat.T
        else:
            p_hat = orthonormalize(p)
            q = m.T @ p_hat
            rebuilt = p_hat @ q.T
        assert relative_error(flat[:120].view(12, 10), rebuilt) < 1e-6, step


@pytest.mark.parametrize("method", ["powersgd", "acp_sgd"])
def test_embedding_tables_travel_whole_unless_asked(method):
    """A matrix the bucket marks as an embedding table is all-reduced whole under the low-rank
    methods (a batch's gradient of one is nonzero in its tokens' rows only);
    ``compress_embeddings`` sends it as factors like any other matrix."""
    bucket = BucketShape(240, [(0, (12, 10)), (120, (12, 10))], frozenset({120}))
    for compress in (False, True):
        options = GradientCompression(
            method=method, rank=2, min_numel=0, compress_embeddings=compress
        )
        codec = LowRankCodec(Communicator(), [bucket], options)
        assert [m.offset for m in codec.matrices[0]] == ([0, 120] if compress else [0])
        grad = torch.randn(240)
        flat = grad.clone()
        codec.all_reduce(0, flat).wait()
        assert torch.equal(flat[120:], grad[120:]) != compress
        assert not torch.equal(flat[:120], grad[:120])


class TiedEmbedding(nn.Module):
    """Tokens to logits through an embedding table that the output layer shares."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens)))).logsumexp(-1).mean()


def compressed_matrices() -> dict[bool, set[str]]:
    """Per ``compress_embeddings``: the names of the parameters PowerSGD sends as factors when
    the engine trains :class:`TiedEmbedding` (one step, so the path runs)."""
    import zerotrain

    out = {}
    for compress in (False, True):
        gradients = {"method": "powersgd", "rank": 2, "min_numel": 0}
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": None,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "comm_compression": {"gradients": {**gradients, "compress_embeddings": compress}},
        }
        engine = zerotrain.initialize(model=TiedEmbedding(), config=config)[0]
        engine.backward(engine(torch.randint(16, (4, 5))))
        engine.step()
        group = engine.optimizer.groups[0]
        names = {(i, s.offset): s.name for i, b in enumerate(group.buckets) for s in b.slots}
        matrices = group.reduction.codec.matrices
        out[compress] = {names[i, m.offset] for i, mats in enumerate(matrices) for m in mats}
    return out


def test_the_engine_marks_embedding_tables_and_the_layers_tied_to_them():
    """2 ranks, PowerSGD: the embedding table, which the output layer shares, travels whole
    unless ``compress_embeddings``; the other matrix goes as factors either way."""
    for per_rank in run_distributed(compressed_matrices, 2):
        assert per_rank == {False: {"mix.weight"}, True: {"mix.weight", "embed.weight"}}


def test_a_matrix_whose_factors_are_not_smaller_travels_whole():
    assert not matrices_codec("powersgd", 6).matrices[0]  # (12 + 10) x 6 > 120
    assert matrices_codec("powersgd", 5).matrices[0]
    assert not matrices_codec("acp_sgd", 10).matrices[0]
    assert matrices_codec("acp_sgd", 9).matrices[0]


def test_config_names_what_each_stage_supports():
    base = {"train_batch_size": 4}
    for method in ("powersgd", "acp_sgd", "topk", "gtopk"):
        with pytest.raises(ConfigError, match=f"{method} compresses a sum.*stage 0-2"):
            load_config(
                {
                    **base,
                    "zero_optimization": {"stage": 3},
                    "comm_compression": {"gradients": {"method": method}},
                },
                world_size=2,
            )
    with pytest.raises(ConfigError, match="comm_compression.gradients.method"):
        load_config({**base, "comm_compression": {"gradients": {"method": "1bit"}}}, world_size=2)
    cfg = load_config(
        {
            **base,
            "zero_optimization": {"stage": 3},
            "comm_compression": {"gradients": {"method": "int4", "block_size": 128}},
        },
        world_size=2,
    )
    assert cfg.comm_compression.gradients.block_size == 128
    # a 1-bit optimizer takes another method after its freeze, which sets the warm-up
    onebit = {"type": "OneBitAdam", "params": {"freeze_step": 10}}
    topk = {"method": "topk", "ratio": 0.1}
    cfg = load_config(
        {**base, "optimizer": onebit, "comm_compression": {"gradients": topk}}, world_size=2
    )
    assert cfg.comm_compression.gradients.method == "topk"
    with pytest.raises(
        ConfigError, match="warmup_steps: optimizer.type OneBitAdam chooses the steps"
    ):
        load_config(
            {
                **base,
                "optimizer": onebit,
                "comm_compression": {"gradients": {**topk, "warmup_steps": 10}},
            },
            world_size=2,
        )


def test_config_refuses_keys_nothing_reads():
    """A key its method does not read is an error naming it, not a silent no-op; with auto
    and both methods at none the keys shape auto's default candidates. ``ratio: true`` is
    not 1.0, and a section that is not a mapping is refused beside ZeRO++'s keys too."""
    onebit = {"type": "OneBitAdam", "params": {"lr": 1e-3}}
    refused = [
        ({"gradients": {"method": "powersgd", "ratio": 0.1}}, {}, "gradients.ratio: acts on topk"),
        ({"gradients": {"method": "topk", "rank": 2}}, {}, "gradients.rank: acts on powersgd"),
        ({"gradients": {"min_numel": 0, "method": "int8"}}, {}, "gradients.min_numel"),
        ({"gradients": {"warmup_steps": 10}}, {}, "warmup_steps: .* gradients.method is none, so"),
        ({"gradients": {"rank": 8}, "auto": True}, {}, "auto's default candidate: int8"),
        ({"gradients": {"block_size": 64}}, {"optimizer": onebit}, "sends its own signs"),
        ({"parameters": {"block_size": 64}}, {"zero_optimization": {"stage": 1}}, "parameters"),
        ({"auto_recheck_steps": 10}, {}, "auto_recheck_steps: .* set auto to true"),
        ({"gradients": {"method": "topk", "ratio": True}}, {}, "ratio: must be a number"),
        ("int4", {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "mapping"),
    ]
    for section, more, match in refused:
        with pytest.raises(ConfigError, match=match):
            load_config({"train_batch_size": 4, **more, "comm_compression": section}, world_size=2)
    accepted = [  # auto's default candidates read these
        ({"gradients": {"block_size": 64}, "auto": True}, {}),
        ({"parameters": {"block_size": 64}, "auto": True}, {"zero_optimization": {"stage": 1}}),
        ({"gradients": {"method": "topk", "ratio": 0.1}}, {"optimizer": onebit}),
    ]
    for section, more in accepted:
        load_config({"train_batch_size": 4, **more, "comm_compression": section}, world_size=2)


def test_a_one_bit_optimizer_the_script_builds_keeps_the_configs_rules():
    """Built by the script, a 1-bit optimizer is refused where its config would be: stage 3,
    a gradients warm-up of its own, auto."""
    import zerotrain

    refused = [
        (3, {}, "stage 3 never forms"),
        (1, {"gradients": {"method": "topk", "warmup_steps": 5}}, "warmup_steps to 0"),
        (1, {"auto": True}, "auto to false"),
    ]
    for stage, section, match in refused:
        with pytest.raises(ValueError, match=f"OneBitAdam .*{match}"):
            zerotrain.initialize(
                model=nn.Linear(4, 4),
                config={
                    "train_batch_size": 1,
                    "zero_optimization": {"stage": stage},
                    "comm_compression": section,
                },
                optimizer=partial(OneBitAdam, lr=1e-3),
            )


def test_compression_with_one_replica_says_it_compresses_nothing():
    import zerotrain

    config = {"train_batch_size": 1, "comm_compression": {"gradients": {"method": "int8"}}}
    with pytest.warns(UserWarning, match="one replica: nothing is compressed"):
        zerotrain.initialize(model=nn.Linear(4, 4), config=config)


def test_a_zero_one_adam_given_as_an_instance_keeps_its_settings():
    """The engine steps a given optimizer over its shards: 0/1 Adam's schedule and local steps,
    kept out of its groups, stay what the step uses (a rebuilt copy once lost them, and it never
    compressed; the object itself is now adopted, as DeepSpeed's clients expect)."""
    import zerotrain

    settings = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_clipper": 4}
    model = nn.Linear(4, 4)
    given = ZeroOneAdam(model.parameters(), lr=1e-3, **settings)
    exact, schedule = given.exact, given.local_steps.schedule
    engine = zerotrain.initialize(
        model=model,
        config={"train_batch_size": 1, "zero_optimization": {"stage": 0}},
        optimizer=given,
    )[0]
    stepping = engine.optimizer.groups[0].store.optimizer
    assert stepping is given and stepping.exact == exact
    assert stepping.local_steps is not None and stepping.local_steps.schedule == schedule
    assert stepping.local_steps.schedule.clipper == 4


# -- codecs on 4 ranks ---------------------------------------------------------------------------
def reference_tree(vectors: list[tuple[torch.Tensor, torch.Tensor]], k: int) -> list[int]:
    """gTop-k's recursive doubling written out over dicts: fold the ranks above the largest
    power of two in, then merge pairs whose numbers differ in one bit, lower rank first."""

    def add(a: dict, b: dict) -> dict:
        out = dict(a)
        for i, v in b.items():
            out[i] = out.get(i, 0.0) + v
        top = sorted(out, key=lambda i: (-abs(out[i]), i))[:k]
        return {i: out[i] for i in top}

    held = [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in vectors]
    power = 1 << (len(held).bit_length() - 1)
    for r in range(power, len(held)):
        held[r - power] = add(held[r - power], held[r])
    bit = 1
    while bit < power:
        held = [add(held[min(r, r ^ bit)], held[max(r, r ^ bit)]) for r in range(power)]
        bit <<= 1
    return sorted(held[0])


def codec_checks() -> dict:
    """On every rank: gTop-k's tree on the world and on a 3-rank group, each codec's limits
    and conservation, and the bytes each sent."""
    world = Communicator()
    three = world.split([[0, 1, 2], [3]])
    out: dict = {}
    for name, comm in (("world", world), ("three", three)):
        gen = torch.Generator().manual_seed(100 + comm.rank)
        values = torch.randn(40, generator=gen)
        indices = top_k(values, 5)
        everyone = comm.all_gather_object((indices, values[indices]))
        if comm.world_size == 3 or name == "world":
            out[f"tree {name}"] = (tree_indices(comm, indices, values[indices]).tolist(), everyone)
        # disjoint supports: the tree's choice is the global top-k of the sum
        disjoint = torch.arange(comm.rank, 40, comm.world_size)[:5]
        mine = values[disjoint] * (comm.rank + 1)
        chosen = tree_indices(comm, disjoint, mine)
        summed = torch.zeros(40).index_add_(
            0,
            torch.cat([i for i, _ in comm.all_gather_object((disjoint, mine))]),
            torch.cat([v for _, v in comm.all_gather_object((disjoint, mine))]),
        )
        out[f"disjoint {name}"] = (chosen.tolist(), top_k(summed, 5).tolist())

    shape = BucketShape(96 + 8, [(0, (12, 8)), (96, (5,))])  # padded to 104 = 4 x 26
    grads = torch.randn(104, generator=torch.Generator().manual_seed(world.rank))
    grads[101:] = 0
    want = grads.clone()
    world.all_reduce(want)
    for method, extra in (
        ("topk", {"ratio": 1.0}),
        ("gtopk", {"ratio": 1.0}),
        ("powersgd", {"rank": 7}),  # (12 + 8) x 7 > 96: whole
        ("acp_sgd", {"rank": 8}),
    ):
        codec = make_codec(GradientCompression(method=method, min_numel=0, **extra), world, [shape])
        flat = grads.clone()
        codec.all_reduce(0, flat).wait()
        out[f"limit {method}"] = relative_error(flat, want)
    # low rank: the factors of the sum of every rank's matrix (each rank's P = M_r Q sums to
    # (sum M_r) Q), the same rebuilt matrix on every rank
    total = want[:96].view(12, 8)
    for method in ("powersgd", "acp_sgd"):
        options = GradientCompression(method=method, rank=3, min_numel=0)
        codec = make_codec(options, world, [shape])
        assert isinstance(codec, LowRankCodec)
        q0 = codec.matrices[0][0].q.clone()
        flat = grads.clone()
        codec.all_reduce(0, flat).wait()
        if method == "powersgd":
            p_hat = orthonormalize(total @ q0)
            rebuilt = p_hat @ (total.T @ p_hat).T
        else:
            q_hat = orthonormalize(q0)
            rebuilt = (total @ q_hat) @ q_hat.T
        # error feedback: the rebuilt sum plus every rank's kept error is the sum of the inputs
        kept = codec.matrices[0][0].error
        assert kept is not None
        kept = kept.clone()
        world.all_reduce(kept)
        conserved = relative_error(flat[:96].view(12, 8) + kept, total)
        out[f"low rank {method}"] = (
            relative_error(flat[:96].view(12, 8), rebuilt),
            flat,
            conserved,
        )
    for method in ("topk", "gtopk"):
        world.reset_stats()
        options = GradientCompression(method=method, ratio=0.1, min_numel=0)
        codec = make_codec(options, world, [shape])
        assert isinstance(codec, SparseCodec)
        flat = grads.clone()
        codec.all_reduce(0, flat).wait()
        out[f"bytes {method}"] = {op: s.sent for op, s in world.stats.items()}
        kept = codec.residuals[0]
        assert kept is not None
        total_kept = torch.zeros(104)
        total_kept[: len(kept)] = kept  # the compressed elements are the bucket's first 101
        world.all_reduce(total_kept)
        out[f"conserved {method}"] = relative_error(flat + total_kept, want)
    # 1 bit with error feedback, stage 0's two hops: the result, the same on every rank, plus
    # every rank's kept error and every owner's error for its piece is the sum of the inputs
    codec = make_codec(GradientCompression(method="onebit", block_size=8), world, [shape])
    flat = grads.clone()
    codec.all_reduce(0, flat).wait()
    kept = codec.worker_errors[0].clone()
    world.all_reduce(kept)
    server = torch.zeros(104)
    server.view(4, 26)[world.rank] = codec.server_errors[0]
    world.all_reduce(server)
    out["onebit"] = (flat, relative_error(flat + kept + server, want))
    # int8 with values exactly on each block's grid: the two hops are exact
    grid = torch.randint(-127, 128, (104,), generator=torch.Generator().manual_seed(world.rank))
    grid = grid.float() / 64
    grid.view(4, 26)[:, ::8] = 127 / 64  # each piece's blocks of 8 have their step at 1/64
    options = GradientCompression(method="int8", block_size=8)
    codec = make_codec(options, world, [BucketShape(104, [(0, (104,))])])
    exact = grid.clone()
    world.all_reduce(exact)
    shard = torch.empty(26)
    world.reset_stats()
    codec.reduce_scatter(0, shard, grid.clone()).wait()
    out["int8 reduce_scatter"] = (shard, exact.view(4, 26)[world.rank])
    out["int8 bytes"] = {op: s.sent for op, s in world.stats.items()}
    # int8 all-reduce of random values: every rank ends with the same, within the bound
    flat = grads.clone()
    make_codec(GradientCompression(method="int8", block_size=8), world, [shape]).all_reduce(
        0, flat
    ).wait()
    out["int8 all_reduce"] = (flat, want)
    # bf16 gradients: the factors and chosen values travel in fp32, what travels whole (the
    # vector and the padding) in bf16, summed as uncompressed bf16 training sums it
    for method in ("powersgd", "acp_sgd", "topk", "gtopk"):
        world.reset_stats()
        options = GradientCompression(method=method, rank=2, ratio=0.1, min_numel=0)
        flat = grads.bfloat16()
        make_codec(options, world, [shape]).all_reduce(0, flat).wait()
        sent = {op: s.sent for op, s in world.stats.items()}
        summed = grads[96:].bfloat16()
        world.all_reduce(summed)
        out[f"bf16 {method}"] = (sent, flat[96:], summed)
    return out


@pytest.fixture(scope="module")
def codec_runs() -> list[dict]:
    return run_distributed(codec_checks, 4)


def test_gtopk_tree_merges_as_the_paper_and_finds_the_global_top_k_of_disjoint_vectors(
    codec_runs,
):
    for name in ("world", "three"):
        results = [r[f"tree {name}"] for r in codec_runs if f"tree {name}" in r]
        chosen, vectors = results[0]
        assert chosen == reference_tree(vectors, 5), name
        assert all(c == chosen for c, _ in results)  # the same on every rank
        for run in codec_runs[: 3 if name == "three" else 4]:
            got, want = run[f"disjoint {name}"]
            assert got == want, name


def test_codecs_at_their_exact_limits_and_error_feedback_conserves(codec_runs):
    """k = every element, rank = the full dimension: the uncompressed sum (1e-6). With
    k = 10%: what was sent plus what every rank kept is the sum of the inputs."""
    for run in codec_runs:
        for method in ("topk", "gtopk", "powersgd", "acp_sgd"):
            assert run[f"limit {method}"] < 1e-6, method
        for method in ("topk", "gtopk"):
            assert run[f"conserved {method}"] < 1e-6, method
        assert run["onebit"][1] < 1e-6
        assert torch.equal(run["onebit"][0], codec_runs[0]["onebit"][0])
        assert relative_error(run["onebit"][0], run["int8 all_reduce"][1]) > 0.1  # 1 bit: lossy


def test_low_rank_codecs_compress_the_sum_over_ranks(codec_runs):
    """PowerSGD and ACP-SGD at rank 3 on 4 ranks: the factors of the sum of the ranks'
    matrices, the same rebuilt gradient on every rank, and the ranks' kept errors adding up to
    what the rebuilt sum left out."""
    for method in ("powersgd", "acp_sgd"):
        first = codec_runs[0][f"low rank {method}"][1]
        for run in codec_runs:
            error, flat, conserved = run[f"low rank {method}"]
            assert error < 1e-5, method
            assert torch.equal(flat, first), method
            assert conserved < 1e-6, method


def test_compressed_bytes_against_their_formulas(codec_runs):
    """Per rank, 4 ranks, a bucket of 101 compressed elements (k = 11) and 3 of padding that
    travel whole: top-k all-gathers k values and k indices (4 bytes each) to 3 peers and
    all-reduces the 3 others; gTop-k swaps 2k numbers in each of log2(4) rounds, then
    all-reduces the k chosen sums with the 3 others."""
    k = math.ceil(0.1 * 101)
    ring = lambda n: 2 * n * 4 * 3 // 4  # noqa: E731 (an all-reduce's bytes sent, fp32)
    for run in codec_runs:
        assert run["bytes topk"] == {"topk": 3 * 2 * k * 4 + ring(3)}
        assert run["bytes gtopk"] == {"gtopk_exchange": 2 * 2 * k * 4, "gtopk": ring(k + 3)}
        # int8 of 104 elements, blocks of 8: each rank sends 3 of its 4 pieces (26 codes and
        # 4 scales each) to their owners
        assert run["int8 bytes"] == {"int8_reduce_scatter": 3 * (26 + 4 * 4)}
        got, want = run["int8 reduce_scatter"]
        assert torch.equal(got, want)
        got, want = run["int8 all_reduce"]
        assert relative_error(got, want) < 0.03
    assert all(
        torch.equal(r["int8 all_reduce"][0], codec_runs[0]["int8 all_reduce"][0])
        for r in codec_runs
    )


def test_what_travels_whole_keeps_the_gradients_16_bit_dtype(codec_runs):
    """bf16 gradients on 4 ranks (a 12 x 8 matrix at rank 2, then 5 + 3 elements of vector and
    padding; for top-k 101 compressed elements, k = 11): the factors and the chosen values
    travel in fp32, what travels whole in bf16, in a collective of its own, and is summed as
    uncompressed bf16 training sums it."""
    k = math.ceil(0.1 * 101)
    ring = lambda n, size: 2 * n * size * 3 // 4  # noqa: E731 (an all-reduce's bytes sent)
    sent = {
        "powersgd": ring(12 * 2, 4) + ring(8 * 2, 4) + ring(8, 2),  # P, then Q
        "acp_sgd": ring(12 * 2, 4) + ring(8, 2),  # P alone at its first step
        "topk": 3 * 2 * k * 4 + ring(3, 2),  # the vector is compressed too (min_numel 0)
        "gtopk": 2 * 2 * k * 4 + ring(k, 4) + ring(3, 2),
    }
    for run in codec_runs:
        for method, want_sent in sent.items():
            stats, got, want = run[f"bf16 {method}"]
            assert sum(stats.values()) == want_sent, (method, stats)
            whole = slice(0, 8) if method in ("powersgd", "acp_sgd") else slice(5, 8)
            assert torch.equal(got[whole], want[whole]), method


# -- training through the engine -----------------------------------------------------------------
ADAM_UNCORRECTED = {  # 1-bit Adam's update before it freezes the variance
    "type": "Adam",
    "params": {"lr": 0.01, "bias_correction": False, "weight_decay": 0.01, "eps": 1e-6},
}
ONEBIT = {"type": "OneBitAdam", "params": {**ADAM_UNCORRECTED["params"], "freeze_step": 2}}
del ONEBIT["params"]["bias_correction"]
# 0/1 Adam updating the variance (exactly) at steps 1, 2, 4, 8: the third in 1 bit
ZERO_ONE = {
    "type": "ZeroOneAdam",
    "params": {**ONEBIT["params"], "var_freeze_step": 10, "var_update_scaler": 1},
}
del ZERO_ONE["params"]["freeze_step"]
# ONEBIT's OneBitAdam built by the script, which gives initialize a factory or an instance
SCRIPT_ONEBIT, ONEBIT_INSTANCE = "OneBitAdam factory", "OneBitAdam instance"
ONE_BITS = (ONEBIT, ZERO_ONE, SCRIPT_ONEBIT, ONEBIT_INSTANCE)
# the 1-bit optimizers' updates with other compressors, at their exact limits (0/1 Adam's
# first 3 steps are OneBitAdam's here)
FROZEN_EXACT = [
    (1, {"optimizer": ONEBIT, "method": "topk", "ratio": 1.0}),
    (1, {"optimizer": ONEBIT, "method": "gtopk", "ratio": 1.0}),
    (2, {"optimizer": ZERO_ONE, "method": "topk", "ratio": 1.0}),
]
TRAIN_CASES = [  # (stage, gradients section); each against the same stage uncompressed
    (0, {"method": "topk", "ratio": 1.0}),
    (0, {"method": "powersgd", "rank": 16}),  # the rank of the first layer's summed gradient
    (1, {"method": "gtopk", "ratio": 1.0}),
    (1, {"method": "acp_sgd", "rank": 40}),
    (2, {"method": "topk", "ratio": 1.0}),
    (2, {"method": "topk", "ratio": 0.05, "warmup_steps": 2}),
    (0, {"method": "int8"}),
    (3, {"method": "int8"}),
    (1, {"parameters": "int8"}),
    (2, {"parameters": "int4"}),
    (3, {"method": "int4", "parameters": "int8"}),
    *[(stage, {"optimizer": ONEBIT}) for stage in (0, 1, 2)],
    (1, {"optimizer": SCRIPT_ONEBIT}),
    (0, {"optimizer": ONEBIT_INSTANCE}),
    *[(stage, {"optimizer": ZERO_ONE}) for stage in (0, 1, 2)],
    *[(stage, {"optimizer": ADAM_UNCORRECTED}) for stage in (0, 1, 2)],
    *FROZEN_EXACT,
]


def every_tensor(grads: dict) -> dict:
    """The gradients section ``grads`` compressing biases too, where its method leaves small
    tensors whole."""
    if grads.get("method") in ("powersgd", "acp_sgd", "topk", "gtopk"):
        return {"min_numel": 0, **grads}
    return grads


def compressed_engine(stage: int, grads: dict, **more):
    """The test model's engine at ``stage`` with ``grads`` as the gradients section (its
    "parameters" entry: the parameters section's method) and the config's keys ``more``."""
    import zerotrain

    grads = dict(grads)
    parameters = {"method": grads.pop("parameters", "none")}
    if parameters["method"] != "none":
        parameters["block_size"] = 64
    optimizer = grads.pop("optimizer", {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 48), nn.GELU(), nn.Linear(48, 3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": None,
        "zero_optimization": {"stage": stage},
        "comm_compression": {"gradients": every_tensor(grads), "parameters": parameters},
        **more,
    }
    if optimizer in (SCRIPT_ONEBIT, ONEBIT_INSTANCE):
        built = partial(OneBitAdam, **ONEBIT["params"])
        given = built if optimizer == SCRIPT_ONEBIT else built(model.parameters())
        return zerotrain.initialize(model=model, config=config, optimizer=given)[0]
    return zerotrain.initialize(model=model, config={**config, "optimizer": optimizer})[0]


def train_steps(engine, gen: torch.Generator, steps: int) -> list[dict]:
    states = []
    for _ in range(steps):
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 40, generator=gen)).pow(2).mean())
            engine.step()
        states.append(engine.consolidated_state_dict())
    return states


def shard_pieces(bucket, rank: int) -> list[int]:
    """The lengths of the pieces of each parameter, then of the padding, in ``bucket``'s shard
    of ``rank``."""
    start, end = bucket.shard_range(rank)
    pieces = [hi - lo for lo, hi in (s.overlap(start, end) for s in bucket.slots) if lo < hi]
    return [*pieces, end - start - sum(pieces)]


def most_blocks(bucket) -> int:
    """The quantization blocks of 64 of the rank's shard of ``bucket`` that has the most, each
    parameter's piece cut into blocks of its own."""
    return max(
        sum(num_blocks(n, 64) for n in shard_pieces(bucket, rank))
        for rank in range(bucket.world_size)
    )


def quantized_per_piece(engine, masters: dict, method: str) -> bool:
    """Whether the model's parameters are the fp32 ``masters`` quantized by ``method`` as each
    rank's shard holds them: each parameter's piece a tensor of its own, in blocks of 64."""
    bits = 8 if method == "int8" else 4
    params = dict(engine.module.named_parameters())
    for bucket in engine.optimizer.group.buckets:
        for rank in range(bucket.world_size):
            start, end = bucket.shard_range(rank)
            for slot in bucket.slots:
                lo, hi = slot.overlap(start, end)
                piece = slice(lo - slot.offset, hi - slot.offset)
                master = masters[slot.name].view(-1)[piece]
                want = dequantize(quantize(master, bits, 64), 64) if lo < hi else master
                if not torch.equal(params[slot.name].detach().view(-1)[piece], want):
                    return False
    return True


def train_compressed(cases: list[tuple[int, dict]], resumed: list[tuple[int, dict]], tmp: str):
    """Each case and each stage's uncompressed run: the model after every step; each resumed
    case: 2 steps, saved, 2 more, against the same 2 more from the checkpoint."""
    import warnings

    rank = Communicator().rank
    out: dict = {}
    for stage, grads in [(s, {"method": "none"}) for s in sorted({s for s, _ in cases})] + cases:
        engine = compressed_engine(stage, grads)
        engine.optimizer.comm.reset_stats()
        states = train_steps(engine, torch.Generator().manual_seed(rank), 3)
        # the model's parameters against the fp32 masters (quantized gathers: within a step)
        masters = engine.consolidated_state_dict()
        for group in engine.optimizer.groups:  # stage 3 refreshes persistent units by its use
            group.residency.wait()
        off = max(
            ((p.detach() - masters[n]).abs().max() / masters[n].abs().max()).item()
            for n, p in engine.module.named_parameters()
            if p.numel() > 0
        )
        sent = {op: s.sent for op, s in engine.optimizer.comm.stats.items()}
        buckets = engine.optimizer.group.buckets
        sent["shards"] = [(b.shard_numel, most_blocks(b)) for b in buckets]
        memory = engine.memory_breakdown()
        sent["vs formula"] = memory["total"] / memory["formula_total"]
        out[stage, str(grads)] = (states, memory["compression"], sent, off)
        if "parameters" in grads:
            out["gathered", stage, str(grads)] = quantized_per_piece(
                engine, masters, grads["parameters"]
            )
    for stage, grads in resumed:
        gen = torch.Generator().manual_seed(rank)
        engine = compressed_engine(stage, grads)
        train_steps(engine, gen, 2)
        engine.save_checkpoint(tmp, tag=f"{stage}{grads['method']}")
        seed = gen.get_state()
        straight = train_steps(engine, gen, 2)
        engine = compressed_engine(stage, grads)
        engine.load_checkpoint(tmp, tag=f"{stage}{grads['method']}")
        gen.set_state(seed)
        out["resumed", stage, str(grads)] = (straight, train_steps(engine, gen, 2))
    # another method's checkpoint: the kept state starts afresh, with a warning
    engine = compressed_engine(2, {"method": "acp_sgd", "rank": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(tmp, tag=f"{resumed[0][0]}{resumed[0][1]['method']}")
    out["warnings"] = [str(w.message) for w in caught]
    # without the optimizer's state, whose step count starts again, so does the compression's
    engine = compressed_engine(*resumed[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(
            tmp, tag=f"{resumed[0][0]}{resumed[0][1]['method']}", load_optimizer_states=False
        )
    codec = engine.optimizer.group.reduction.codec
    errors = [e for mats in codec.state_dict()["factors"] for _, _, e in mats]
    out["without the optimizer"] = codec.steps, errors, [str(w.message) for w in caught]
    return out


RESUMED = [  # (stage, gradients section): resumed exactly
    (0, {"method": "powersgd", "rank": 2}),
    (1, {"method": "acp_sgd", "rank": 2}),
    (2, {"method": "gtopk", "ratio": 0.1}),
    (1, {"method": "topk", "ratio": 0.1, "warmup_steps": 1}),
    (2, {"method": "topk", "ratio": 0.1, "optimizer": ADAM_UNCORRECTED}),  # Adam catching up
]


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory) -> list[dict]:
    return run_distributed(
        train_compressed, 4, TRAIN_CASES, RESUMED, str(tmp_path_factory.mktemp("ckpt"))
    )


def steps_apart(states: list[dict], reference: list[dict]) -> list[float]:
    """After each step, the largest relative error of any tensor of ``states`` against
    ``reference``."""
    return [
        max(relative_error(s[key], r[key]) for key in r)
        for s, r in zip(states, reference, strict=True)
    ]


def test_training_at_the_exact_limits_matches_uncompressed_training(training_runs):
    """4 ranks: top-k of every element, gTop-k likewise, and ACP-SGD at full rank, where its
    matrices travel whole, stages 0-2: the uncompressed run's weights after each step (1e-6).
    PowerSGD at rank 16, the rank of the first layer's gradient summed over the step's 16
    samples, compresses it and rebuilds it exactly, to rounding (1e-5). A warm-up of 2 steps:
    the first two steps are uncompressed, the third is not. Quantized gradients and parameter
    gathers: close, the model's parameters within one quantization step of the fp32 masters,
    and exactly the masters quantized as each rank's shard holds them, each parameter's piece
    in blocks of its own; at stages 1-2 each step's parameter all-gather sends every bucket's
    shard to 3 peers as codes (1 byte per element at int8, half at int4) and one fp32 scale
    per block of 64 (as many as the shard with the most)."""
    for per_rank in training_runs:
        for stage, grads in TRAIN_CASES:
            states, kept, sent, off = per_rank[stage, str(grads)]
            plain, _, plain_sent, plain_off = per_rank[stage, str({"method": "none"})]
            assert plain_off == 0.0
            errors = steps_apart(states, plain)
            if "optimizer" in grads:
                if grads["optimizer"] in ONE_BITS:  # 2 exact steps, then compressed
                    reference, _, _, _ = per_rank[stage, str({"optimizer": ADAM_UNCORRECTED})]
                    off_adam = steps_apart(states, reference)
                    assert max(off_adam[:2]) < 1e-6 and off_adam[2] > 1e-4, (stage, off_adam)
                    assert kept >= 4 * 2115, stage  # each rank's error, fp32, every element
                if "method" in grads:  # another compressor after the freeze: exact here
                    assert sent[grads["method"]] > 0, grads
                    # top-k and gTop-k of every element agree, at stages 1 and 2; signs do not
                    # (0.7 apart). The exact run is stage 1's: stage 2 sums in another order
                    # from step 1 (4e-8 apart), and the frozen variance amplifies that (1.04e-6
                    # at step 3 on an AVX-512 CPU), hence 1e-5
                    exact = per_rank[FROZEN_EXACT[0][0], str(FROZEN_EXACT[0][1])][0]
                    signs = per_rank[stage, str({"optimizer": ONEBIT})][0]
                    for other, agrees in (exact, True), (signs, False):
                        apart = steps_apart(states, other)
                        assert (apart[2] < 1e-5) == agrees, (grads, apart)
                elif grads["optimizer"] in ONE_BITS:
                    # the same exact steps (1, 2), the same 1-bit step 3: the same model
                    one_bit, _, _, _ = per_rank[stage, str({"optimizer": ONEBIT})]
                    assert all(
                        torch.equal(s[key], o[key])
                        for s, o in zip(states, one_bit, strict=True)
                        for key in s
                    ), stage
                continue
            # model states on the ZeRO formula (padding only), masters apart with quantized
            # parameter gathers
            assert sent["vs formula"] == pytest.approx(1.0, abs=0.01), (stage, grads)
            parameters = grads.get("parameters")
            if parameters is not None:
                bits = 8 if parameters == "int8" else 4
                assert 0 < off <= 1 / (127 if bits == 8 else 7), (stage, grads, off)
                assert per_rank["gathered", stage, str(grads)], (stage, grads)
                if stage < 3:
                    per_step = sum(
                        3 * (code_bytes(n, bits) + 4 * blocks) for n, blocks in sent["shards"]
                    )
                    assert sent[f"{parameters}_param_all_gather"] == 3 * per_step, (stage, grads)
            if grads.get("method") in ("int8", "int4") or parameters is not None:
                assert max(errors) < (0.05 if "int4" not in str(grads) else 0.3), (stage, grads)
                assert kept == 0
            elif "warmup_steps" in grads:
                assert errors[:2] == [0.0, 0.0] and errors[2] > 1e-3, errors
                assert kept > 0  # the residual, once compression started
            elif grads.get("method") == "powersgd":  # compressed: exact up to rounding
                assert sent["powersgd"] > 0 and max(errors) < 1e-5, (stage, errors)
            else:
                assert max(errors) < 1e-6, (stage, grads, errors)


def test_resume_with_compression_is_bitwise_an_uninterrupted_run(training_runs):
    """Error feedback, low-rank factors, ACP-SGD's phase, the warm-up's count and the steps
    each element waited (an Adam catching up) come back from the checkpoint: the same bits as
    training on. Another method's state is refused with a warning and starts afresh; a load
    without the optimizer's state starts it afresh at step 0, as the optimizer, silently."""
    for per_rank in training_runs:
        for stage, grads in RESUMED:
            straight, resumed = per_rank["resumed", stage, str(grads)]
            for a, b in zip(straight, resumed, strict=True):
                assert all(torch.equal(a[key], b[key]) for key in a), (stage, grads)
        assert any(
            "starts afresh: the checkpoint holds state of 'powersgd'" in w
            for w in per_rank["warnings"]
        ), per_rank["warnings"]
        steps, errors, warned = per_rank["without the optimizer"]
        assert steps == 0 and errors and all(e is None for e in errors) and not warned


def fp16_steps(cases: dict[str, dict], fp16: dict, steps: int, poisoned: int | None) -> dict:
    """fp16 training of ``steps`` steps under the ``fp16`` section with each gradients section
    (its "optimizer": the optimizer section), rank 1's loss infinite at step ``poisoned`` (0-based;
    None: never). Per case: which steps were skipped, and the parameters at the end."""
    import zerotrain

    rank = Communicator().rank
    out = {}
    for name, grads in cases.items():
        grads = dict(grads)
        optimizer = grads.pop("optimizer", {"type": "AdamW", "params": {"lr": 0.01}})
        torch.manual_seed(0)
        engine = zerotrain.initialize(
            model=nn.Sequential(nn.Linear(40, 48), nn.GELU(), nn.Linear(48, 3)),
            config={
                "train_micro_batch_size_per_gpu": 4,
                "steps_per_print": None,
                "optimizer": optimizer,
                "fp16": {"enabled": True, **fp16},
                "zero_optimization": {"stage": 2},
                "comm_compression": {"gradients": every_tensor(grads)},
            },
        )[0]
        gen = torch.Generator().manual_seed(rank)
        skipped = []
        for step in range(steps):
            loss = engine(torch.randn(4, 40, generator=gen).half()).float().pow(2).mean()
            engine.backward(loss * float("inf") if step == poisoned and rank == 1 else loss)
            engine.step()
            skipped.append(not engine.was_step_applied())
        params = torch.cat([p.detach().float().view(-1) for p in engine.module.parameters()])
        out[name] = skipped, params
    return out


def one_bit_with_int4_gathers(steps: int) -> list[float]:
    """ONEBIT (2 exact steps, then signs) with int4 parameter gathers at stage 1: after each
    step, the largest difference between the engine's masters and those of the same training
    written out here for every rank with the compression operators (see the test)."""
    import zerotrain.zero.group as group_module

    # no clipping: the norm sums in another order here
    engine = compressed_engine(1, {"optimizer": ONEBIT, "parameters": "int4"}, gradient_clipping=0)
    world = engine.optimizer.comm.world_size
    (bucket,) = engine.optimizer.group.buckets
    first = engine.consolidated_state_dict()
    states = train_steps(engine, torch.Generator().manual_seed(engine.optimizer.comm.rank), steps)

    def flat_of(tensors: dict) -> torch.Tensor:
        flat = torch.cat([tensors[s.name].view(-1) for s in bucket.slots])
        return torch.cat([flat, flat.new_zeros(bucket.numel_padded - bucket.numel)])

    masters = nn.Parameter(flat_of(first))
    reference = OneBitAdam([masters], **ONEBIT["params"])
    model = nn.Sequential(nn.Linear(40, 48), nn.GELU(), nn.Linear(48, 3))
    params = dict(model.named_parameters())
    gens = [torch.Generator().manual_seed(rank) for rank in range(world)]
    errors = [torch.zeros_like(masters) for _ in range(world)]
    block, shard_numel = group_module.ONEBIT_BLOCK, bucket.shard_numel
    used = masters.detach().clone()  # the first step's parameters: rank 0's, exact
    apart = []
    for step, state in enumerate(states, start=1):
        for slot in bucket.slots:
            params[slot.name].data = used[slot.offset : slot.offset + slot.numel].view(slot.shape)
        wires = []
        for gen in gens:  # each rank's gradient of its 2 micro-batches, times 1/N
            model.zero_grad()
            for _ in range(2):
                (model(torch.randn(2, 40, generator=gen)).pow(2).mean() / 2).backward()
            wires.append(flat_of({n: p.grad for n, p in params.items()}) / world)
        if step <= 2:  # exact; two ranks' sum is the same in either order
            masters.grad = wires[0] + wires[1]
        else:  # each rank sends its pieces in signs, keeping its error; each owner sums them
            sent = []
            for rank in range(world):
                x = wires[rank] + errors[rank]
                pieces = [sign_compress(piece, block) for piece in x.view(world, -1)]
                sent.append([sign_decompress(*piece, shard_numel, block) for piece in pieces])
                errors[rank] = x - torch.cat(sent[-1])
            masters.grad = torch.cat(
                [
                    sum((sent[rank][owner] for rank in range(world)), torch.zeros(shard_numel))
                    for owner in range(world)
                ]
            )
        reference.step()
        # the int4 gather: each rank's shard quantized piece by piece, in blocks of 64
        used = torch.cat(
            [
                dequantize(quantize(piece, 4, 64), 64)
                for rank in range(world)
                for piece in bucket.shard(masters.detach(), rank).split(shard_pieces(bucket, rank))
            ]
        )
        # (the padding, whose gradient is zero, takes ± the signs' scale: no parameter's)
        apart.append((flat_of(state) - masters.detach())[: bucket.numel].abs().max().item())
    return apart


@pytest.mark.timeout(120)
def test_one_bit_adam_with_int4_gathers_trains_as_written_out():
    """OneBitAdam (2 exact steps) with int4 parameter gathers at stage 1 on 2 ranks: after each
    of 5 steps the masters equal, bit for bit, those of the training written out with the
    operators: every rank's gradient at the gathered parameters, exact sums, then each rank's
    gradient plus its kept error in signs to each owner, OneBitAdam's update on exact fp32
    masters, and the gather quantizing each rank's shard piece by piece. Before the gather's
    blocks ended at parameters, apart from step 2 on (the parameters were others)."""
    for apart in run_distributed(one_bit_with_int4_gathers, 2, 5):
        assert apart == [0.0] * 5, apart


ONEBIT_FROM_STEP_3 = {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 2}}
CARRYING_ERROR = {
    "topk": {"method": "topk", "ratio": 0.1},
    "gtopk": {"method": "gtopk", "ratio": 0.1},
    "powersgd": {"method": "powersgd", "rank": 2},
    "acp_sgd": {"method": "acp_sgd", "rank": 2},
    "onebit": {"optimizer": ONEBIT_FROM_STEP_3},
}


def test_one_non_finite_gradient_skips_one_compressed_step():
    """The error feedback (and PowerSGD's factors) that one rank's infinite gradient reaches
    drop what it made non-finite when the step is skipped: the steps after it train. Before,
    the residual kept the infinities and every later step overflowed."""
    fp16 = {"initial_scale_power": 4}
    for per_rank in run_distributed(fp16_steps, 2, CARRYING_ERROR, fp16, 8, 3):
        for name, (skipped, _) in per_rank.items():
            assert skipped == [False] * 3 + [True] + [False] * 4, (name, skipped)


def static_and_doubling_scale() -> tuple[dict, dict]:
    static, doubling = {"loss_scale": 256}, {"initial_scale_power": 8, "loss_scale_window": 1}
    return tuple(fp16_steps(CARRYING_ERROR, fp16, 5, None) for fp16 in (static, doubling))


def test_error_feedback_follows_a_changing_loss_scale():
    """A dynamic loss scale doubling every step (256, 512, ...) scales the fp16 gradients by
    powers of two, exactly, so training is bit for bit that at a static 256: the error kept
    in one step's scaled units follows the scale to the next's. Before, it stayed in the units
    it was kept in (3e-3 apart after 4 steps)."""
    for at_256, doubling in run_distributed(static_and_doubling_scale, 2):
        for name in CARRYING_ERROR:
            assert not any(at_256[name][0] + doubling[name][0]), name
            assert torch.equal(at_256[name][1], doubling[name][1]), name


def test_a_codec_refuses_state_of_another_layout():
    shape = BucketShape(120, [(0, (12, 10))])
    options = GradientCompression(method="topk", ratio=0.5, min_numel=0)
    codec = make_codec(options, Communicator(), [shape])
    assert codec.load_state_dict(None, steps=3) is None  # one process: nothing compressed
    sparse = SparseCodec(Communicator(), [shape], options)
    sparse.residuals = [torch.ones(120)]
    state = sparse.state_dict()
    other = SparseCodec(Communicator(), [BucketShape(60, [(0, (6, 10))])], options)
    assert "another bucket layout" in str(other.load_state_dict(state, steps=3))
    assert other.steps == 3 and other.residuals == [None]
    assert sparse.load_state_dict(state, steps=5) is None and sparse.steps == 0


# -- convergence: the demo GPT's architecture on the embedded corpus (slow) -----------------------
CONVERGENCE = {  # name: (stage, comm_compression gradients/parameters, optimizer type)
    "uncompressed s1": (1, {}, "AdamW"),
    "powersgd r4 s1": (1, {"method": "powersgd", "rank": 4}, "AdamW"),
    "acp_sgd r8 s1": (1, {"method": "acp_sgd", "rank": 8}, "AdamW"),
    "topk 10% s2": (2, {"method": "topk", "ratio": 0.1}, "AdamW"),
    "gtopk 10% s2": (2, {"method": "gtopk", "ratio": 0.1}, "AdamW"),
    "int8 + int8 params s1": (1, {"method": "int8", "parameters": "int8"}, "AdamW"),
    "int4 + int4 params s3": (3, {"method": "int4", "parameters": "int4"}, "AdamW"),
    "OneBitAdam uncompressed s1": (1, {}, "OneBitAdam uncompressed"),
    "OneBitAdam s1": (1, {}, "OneBitAdam"),
    "ZeroOneAdam s1": (1, {}, "ZeroOneAdam"),
    # the low-rank and sparse methods in place of the signs, under the frozen variance
    "OneBitAdam + powersgd r4 s1": (1, {"method": "powersgd", "rank": 4}, "OneBitAdam"),
    "OneBitAdam + acp_sgd r8 s1": (1, {"method": "acp_sgd", "rank": 8}, "OneBitAdam"),
    "OneBitAdam + topk 10% s2": (2, {"method": "topk", "ratio": 0.1}, "OneBitAdam"),
    "OneBitAdam + gtopk 10% s2": (2, {"method": "gtopk", "ratio": 0.1}, "OneBitAdam"),
    # the signs with int4 parameter gathers (blocks across parameters made dead units there:
    # [Note: quantized parameter all-gather] in zerotrain/compression/gather.py)
    "OneBitAdam + int4 params s1": (1, {"parameters": "int4"}, "OneBitAdam"),
}
HELD_OUT, EVAL_BATCH = 64, 16  # sequences of the validation split, the same for every run


@dataclass(frozen=True)
class Training:
    """How :func:`train_gpt` trains. The defaults are a stable regime: at micro-batch 4
    and lr 3e-3 the final held-out loss moves by 7.4% between model seeds, more than the
    bounds, and at 16 and 1e-3 by 0.6% (uncompressed, 2 ranks; bench/convergence.py --rows
    seeds)."""

    steps: int = 300
    seed: int = 0  # the model's
    compression_warmup: int = 20  # exact steps before gradient compression
    micro_batch: int = 16
    lr: float = 1e-3  # the Adam family's (SGD's: 0.1, momentum 0.9)
    model: str = "tiny"  # the examples' GPT preset

    @property
    def compressed_from(self) -> int:
        """The first step (0-based) at which every run compresses: after the warm-up, and after
        the 1-bit optimizers' freeze."""
        return max(ONE_BIT_FREEZE, self.compression_warmup)


ONE_BIT_FREEZE = 100  # the 1-bit optimizers' freeze_step and var_freeze_step here
# ZeroOneAdam's var_update_scaler here: its first 1-bit step is step 33, after the learning
# rate's 20 warm-up steps (the bound is for 1 bit after warm-up). At DeepSpeed's default of
# 16 it is step 17, and 0/1 Adam ends +16.1% (2 ranks), +6.5% (4) (bench/convergence.py
# --rows onebit).
ZERO_ONE_SCALER = 32
ONE_BIT_RUNS = ("OneBitAdam", "ZeroOneAdam")


def train_gpt(runs: dict[str, tuple], training: Training = Training()) -> dict:
    """Each run (name: as in CONVERGENCE): the tiny GPT, trained as ``training`` says, the
    learning rate warmed up over 20 steps. Per run: the bytes this rank sent per step, and the
    final model's loss on held-out text."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt.data import train_val_datasets
    from gpt.model import GPT, gpt_config

    import zerotrain

    config = gpt_config(training.model)
    train_set, val_set = train_val_datasets(config.block_size)
    held_out = [val_set[i * len(val_set) // HELD_OUT] for i in range(HELD_OUT)]
    world = Communicator()
    micro = training.micro_batch
    out = {}
    for name, (stage, section, optimizer) in runs.items():
        section = dict(section)
        parameters = section.pop("parameters", "none")
        more_params = section.pop("optimizer_params", {})  # bench/convergence.py's rows
        # the 1-bit optimizers compress from their freeze; uncompressed has no warm-up
        if section and not optimizer.startswith(ONE_BIT_RUNS):
            section["warmup_steps"] = training.compression_warmup
        params = {"lr": training.lr, "weight_decay": 0.01}
        if optimizer == "SGD":
            params = {"lr": 0.1, "momentum": 0.9}
        # the 1-bit optimizers' updates with every gradient exact (bench/convergence.py)
        exact = optimizer.endswith(", exact")
        optimizer = optimizer.removesuffix(", exact")
        if optimizer.startswith("OneBitAdam"):  # its variance must settle before it freezes
            params["betas"] = [0.9, 0.99]
            frozen = optimizer != "OneBitAdam uncompressed"
            params["freeze_step"] = ONE_BIT_FREEZE if frozen else 10**6
            optimizer = "OneBitAdam"
        if optimizer == "ZeroOneAdam":  # variance updates thinning out until the freeze
            params["betas"] = [0.9, 0.99]
            params["var_freeze_step"] = ONE_BIT_FREEZE
            params["var_update_scaler"] = ZERO_ONE_SCALER
        params.update(more_params)
        torch.manual_seed(training.seed)
        engine = zerotrain.initialize(
            model=GPT(config),
            config={
                "train_micro_batch_size_per_gpu": micro,
                "optimizer": {"type": optimizer, "params": params},
                "scheduler": {
                    "type": "WarmupLR",
                    "params": {"warmup_max_lr": params["lr"], "warmup_num_steps": 20},
                },
                "steps_per_print": None,
                "zero_optimization": {"stage": stage},
                "comm_compression": {
                    "gradients": section,
                    "parameters": {"method": parameters},
                },
            },
        )[0]
        if exact:
            for group in engine.optimizer.groups:
                reduction = group.reduction
                reduction.codec = make_codec(None, reduction.comm, reduction.shapes)
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(1))
        sent = []
        comm = engine.optimizer.comm
        for step in range(training.steps):
            first = (step * world.world_size + world.rank) * micro
            batch = [train_set[int(i)] for i in order[first : first + micro]]
            before = sum(s.sent for s in comm.stats.values())
            loss = engine(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
            engine.backward(loss)
            engine.step()
            sent.append(sum(s.sent for s in comm.stats.values()) - before)
        out[name] = (sent, held_out_loss(engine, held_out))
    return out


def held_out_loss(engine, held_out: list) -> float:
    """The mean loss of ``engine``'s model over the held-out (input, target) sequences, in
    batches of EVAL_BATCH (every rank holds the same model: each evaluates all of it)."""
    with torch.no_grad():
        losses = [
            engine(
                torch.stack([b[0] for b in held_out[i : i + EVAL_BATCH]]),
                torch.stack([b[1] for b in held_out[i : i + EVAL_BATCH]]),
            ).item()
            for i in range(0, len(held_out), EVAL_BATCH)
        ]
    return sum(losses) / len(losses)


def median_sent(sent: list[int], training: Training = Training()) -> int:
    """The bytes sent in the median step once every method compresses."""
    later = sorted(sent[training.compressed_from :])
    if not later:
        raise ValueError(f"{len(sent)} steps: train more than {training.compressed_from}")
    return later[len(later) // 2]


def convergence_bound(run: tuple) -> float:
    """How far above its baseline a run's final loss may end: 3% for 1-bit signs (after their
    warm-up, with parameter gathers compressed or not), 2% for the other methods."""
    _, section, optimizer = run
    return 1.03 if optimizer in ONE_BIT_RUNS and "method" not in section else 1.02


def convergence_baseline(name: str) -> str:
    """The run a convergence run is measured against: the same optimizer uncompressed (the
    1-bit optimizers: OneBitAdam's update with its variance never frozen, at stage 0 for the
    runs at stage 0 (bench/convergence.py --rows local), else 1)."""
    if name.startswith(ONE_BIT_RUNS):
        return "OneBitAdam uncompressed " + ("s0" if name.endswith(" s0") else "s1")
    return "SGD uncompressed s1" if name.startswith("SGD") else "uncompressed s1"


# Measured gaps (python: the loop below on this machine, 2026-11-24): the methods that end
# further than the bound from their baseline, by world size. Equality is asserted, so a new
# gap fails the test and so does a closed one (then remove it here).
# Top-k and gTop-k under AdamW end 1.8-2.6% below it by catching up (zerotrain/optim/catch_up.py;
# without it, +5.0-7.5%: bench/convergence.py --rows sparse).
# Under OneBitAdam's frozen variance top-k and gTop-k come within 0.5-1.1%, ACP-SGD does not.
ACP_FROZEN = "OneBitAdam + acp_sgd r8 s1"  # +4.7% (2 ranks), +4.5% (4)
# The signs with int4 parameter gathers: +3.8% (2 ranks), +1.7% (4) (+27.1% on 2 ranks while
# blocks spanned parameters). Where the variance froze near zero, the signs' kept error moves a
# master far (block 1's qkv weights reach 1.5 on the 2-block GPT, 1.0 with exact gradients),
# and such a value sets its int4 block's scale for the rest of the block.
ONE_BIT_INT4 = "OneBitAdam + int4 params s1"
KNOWN_GAPS = {
    2: {"acp_sgd r8 s1", ACP_FROZEN, ONE_BIT_INT4},
    4: {"powersgd r4 s1", "acp_sgd r8 s1", ACP_FROZEN},
}  # 2 ranks: +4.4%; 4 ranks: +3.0, 5.4%


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 4 ranks: about 5 minutes alone on this machine's 2 cores
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_training_converges_like_uncompressed(world):
    """300 steps of the tiny GPT on the embedded corpus: each method's held-out loss within 2%
    of uncompressed AdamW's, OneBitAdam and ZeroOneAdam within 3% of OneBitAdam's update
    uncompressed (OneBitAdam's signs with int4 parameter gathers too; other methods under that
    update: 2%), with fewer bytes per step once
    compression runs (the median step). Between model seeds the baseline's held-out loss
    moves by 0.5-0.6% (bench/convergence.py --rows seeds)."""
    runs = run_distributed(train_gpt, world, CONVERGENCE, timeout=1200)[0]
    final = {name: held for name, (_, held) in runs.items()}
    median = {name: median_sent(sent) for name, (sent, _) in runs.items()}
    gaps = set()
    for name, run in CONVERGENCE.items():
        if final[name] > final[convergence_baseline(name)] * convergence_bound(run):
            gaps.add(name)
        if "uncompressed" not in name:
            assert median[name] < median["uncompressed s1"], (name, median)
    assert gaps == KNOWN_GAPS[world], final

"""transformers' ``from_pretrained`` under a ZeRO-3 config, on zerotrain through the alias.

transformers builds the model inside ``prevent_arange_dtype_change()`` and
``deepspeed.zero.Init(config_dict_or_path=...)``: the first reads and replaces
``deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor`` (and
compares against ``_orig_torch_arange``), the second must make its constructor wrappers through
that replacement. Each rank is a fresh interpreter that activates the alias before importing
transformers, as a user's script under ``zerotrain run --deepspeed-compat`` does.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from distributed import run_distributed

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate", "safetensors")),
    reason="needs transformers, accelerate and safetensors",
)

CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


def _llama_config():
    from transformers import LlamaConfig

    # 760 parameters; a tied-free Llama with rotary embeddings (its inv_freq buffer)
    return LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )


def load_under_zero3(folder: str) -> dict:
    from zerotrain.compat.deepspeed import activate

    activate()
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters as pp
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    saved = load_file(f"{folder}/model.safetensors")
    originals = {name: getattr(torch, name) for name in CONSTRUCTORS}
    seen: dict = {"values_equal": {}, "dtypes": {}, "buffers": {}, "chunked": {}}
    wrapper = pp.zero_wrapper_for_fp_tensor_constructor
    asked = []

    def spy(fn, *args, **kwargs):
        # who asked for which constructor: transformers' override passes all but arange on
        asked.append((fn.__name__, __import__("sys")._getframe(1).f_code.co_name, kwargs))
        return wrapper(fn, *args, **kwargs)

    pp.zero_wrapper_for_fp_tensor_constructor = spy
    for precision in ("bf16", "fp32"):
        ds = {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": {"stage": 3},
        }
        hf_ds = HfDeepSpeedConfig(ds)  # held: transformers keeps only a weak reference
        model = LlamaForCausalLM.from_pretrained(folder)
        params = dict(model.named_parameters())
        seen["chunked"][precision] = all(
            p.dim() == 1 and hasattr(p, "ds_id") for p in params.values()
        )
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        with deepspeed.zero.GatheredParameters(list(params.values())):
            seen["values_equal"][precision] = {
                name: torch.equal(p.data, saved[name].to(dtype)) for name, p in params.items()
            }
        seen["dtypes"][precision] = {p.dtype for p in params.values()}
        seen["buffers"][precision] = {n: b.clone() for n, b in model.named_buffers()}
        del hf_ds
    seen["asked"] = asked
    seen["wrapper_back"] = pp.zero_wrapper_for_fp_tensor_constructor is spy  # HF restored its own
    pp.zero_wrapper_for_fp_tensor_constructor = wrapper
    seen["constructors_back"] = all(getattr(torch, n) is f for n, f in originals.items())
    # the next model, outside any Init and without the ZeRO-3 config: a normal one on the CPU
    plain = LlamaForCausalLM.from_pretrained(folder)
    built = LlamaForCausalLM(_llama_config())
    seen["plain"] = [
        (t.device.type, tuple(t.shape), hasattr(t, "ds_id"))
        for t in [*plain.parameters(), *built.parameters(), *plain.buffers()]
    ]
    seen["plain_equal"] = all(torch.equal(p, saved[n]) for n, p in plain.named_parameters())
    seen["plain_buffers"] = {n: b.clone() for n, b in plain.named_buffers()}
    return seen


# one rank in the default suite (a fresh interpreter importing transformers is most of the
# time); two, where each rank holds a different chunk, with the slow tests
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_from_pretrained_under_a_zero3_config_loads_partitioned_and_leaves_torch_as_it_was(
    tmp_path, world
):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM(_llama_config())
    reference.save_pretrained(tmp_path)
    names = dict(reference.named_parameters())
    ranks = run_distributed(
        load_under_zero3, world, str(tmp_path), timeout=300, fresh_interpreter=True
    )
    for seen in ranks:
        for precision in ("bf16", "fp32"):
            assert seen["chunked"][precision]
            assert set(seen["values_equal"][precision]) == set(names)
            assert all(seen["values_equal"][precision].values()), seen["values_equal"]
        assert seen["dtypes"] == {"bf16": {torch.bfloat16}, "fp32": {torch.float32}}
        # RoPE's inverse frequencies, made with explicit dtypes, are as in a plain model
        for precision in ("bf16", "fp32"):
            for name, buffer in seen["buffers"][precision].items():
                assert buffer.dtype == torch.float32, (precision, name)
                assert torch.equal(buffer, seen["plain_buffers"][name]), (precision, name)
        # transformers' override was what Init called: every constructor but arange passed on
        # to the wrapper by it, with the keywords DeepSpeed's Init passes
        asked = seen["asked"]
        assert sorted({fn for fn, _, _ in asked}) == sorted(set(CONSTRUCTORS) - {"arange"})
        assert len(asked) == 2 * (len(CONSTRUCTORS) - 1)  # two loads
        assert {caller for _, caller, _ in asked} == {"wrapper_without_arange"}
        assert all(set(kwargs) == {"target_fp_dtype", "target_device"} for *_, kwargs in asked)
        assert seen["wrapper_back"] and seen["constructors_back"]
        assert {entry[0] for entry in seen["plain"]} == {"cpu"}
        assert not any(entry[2] for entry in seen["plain"])
        assert seen["plain_equal"]

"""Weights of a meta-device model placed on several ranks, initialised without building it whole anywhere."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT


def init_by_module(section: dict[str, Any], strategy: str, by_module: bool = True) -> dict | None:
    """On each rank: place a meta-device model whose whole-model init fails; rank 0 returns its full weights and
    the largest number of parameter elements it initialised at once. ``by_module=False``: rank 0 initialises the
    whole model and sends its weights, as for a model that cannot be initialised a module at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from foundry.distributed import get_rank
    from foundry.distributed.config import FSDPConfig
    from foundry.distributed.placement import parallelize
    from foundry.distributed.process_group import init_process_group
    from foundry.models.build import build_model

    init_process_group()
    torch.manual_seed(0)
    model = build_model({**section, "init_device": "meta"})
    steps, at_once = model.init_steps(), []

    def counted(initialise):
        def one_module(module: torch.nn.Module) -> None:
            at_once.append(sum(param.numel() for param in module.parameters(recurse=False)))
            initialise(module)

        return one_module

    def whole_model() -> None:
        raise AssertionError("rank 0 initialised the whole model at once")

    if by_module:
        model.init_weights = whole_model
        model.init_steps = lambda: [(module, counted(initialise)) for module, initialise in steps]
    else:
        model.init_steps = lambda: None
    parallelize(model, FSDPConfig(sharding_strategy=strategy), torch.device("cpu"), "fp32")
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"weights": weights, "most_at_once": max(at_once, default=0)} if get_rank() == 0 else None


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])  # shards; replicas (DTensor Replicate)
@pytest.mark.parametrize(
    "section",
    [{"name": "mpt_causal_lm", **TINY_MPT}, {"name": "llama_causal_lm", **TINY_LLAMA, "tie_word_embeddings": False}],
    ids=["mpt-tied", "llama-gqa"],
)
def test_meta_init_holds_one_module_at_a_time_and_gives_the_unsharded_weights(ranks, section, strategy):
    from foundry.models.build import build_model

    placed = ranks.run(2, init_by_module, section, strategy)[0]
    torch.manual_seed(0)
    model = build_model({**section, "init_device": "cpu"})
    unsharded = model.state_dict()
    assert placed["weights"].keys() == unsharded.keys()
    for name, weight in unsharded.items():
        assert torch.equal(placed["weights"][name], weight), name
    largest_module = max(sum(param.numel() for param in module.parameters(recurse=False)) for module in model.modules())
    assert placed["most_at_once"] == largest_module < sum(param.numel() for param in model.parameters()) / 4


@pytest.mark.parametrize("quantize_base", [False, True], ids=["lora", "qlora"])
def test_lora_meta_init_holds_one_module_at_a_time_and_gives_rank_0s_whole_init(ranks, quantize_base):
    """Adapters drawn after the whole base (as init_weights draws them) and NF4 base weights rounded as rank 0's
    quantized model holds them: the same shards as when rank 0 initialises the whole model and sends it."""
    if quantize_base:
        pytest.importorskip("torchao")
    peft_config = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "quantize_base": quantize_base}
    # 256 wide: each rank's half of every adapted weight is whole NF4 scale blocks (64 × 256 weights).
    wide = {"d_model": 256, "multiple_of": 256, "tie_word_embeddings": False}
    section = {"name": "llama_causal_lm", **TINY_LLAMA, **wide, "peft_config": peft_config}
    by_module = ranks.run(2, init_by_module, section, "FULL_SHARD")[0]
    whole = ranks.run(2, init_by_module, section, "FULL_SHARD", by_module=False)[0]
    assert by_module["weights"].keys() == whole["weights"].keys()
    for name, weight in whole["weights"].items():
        assert torch.equal(by_module["weights"][name], weight), name
    adapters_a = [weight for name, weight in whole["weights"].items() if name.endswith("lora_A.weight")]
    adapters_b = [weight for name, weight in whole["weights"].items() if name.endswith("lora_B.weight")]
    assert adapters_a and all(a.abs().sum() > 0 for a in adapters_a) and all(not b.any() for b in adapters_b)
    total = sum(weight.numel() for weight in whole["weights"].values())
    assert 0 < by_module["most_at_once"] < total / 4


def peak_host_bytes_of_placement(section: dict[str, Any]) -> dict | None:
    """On each rank: place a meta-device model a module at a time, then as rank 0's whole model; rank 0 returns
    how far its resident memory rose above where it started, each time (the kernel's high-water mark, reset)."""
    import ctypes

    from foundry.distributed import get_rank
    from foundry.distributed.config import FSDPConfig
    from foundry.distributed.placement import parallelize
    from foundry.distributed.process_group import init_process_group
    from foundry.models.build import build_model
    from foundry.models.nf4 import torchao_nf4

    def resident_kib(field: str) -> int:
        return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))

    init_process_group()
    # torchao quantizes 2^20 weights at a time through ~64 MB of scratch, at any model size: a smaller chunk here
    # lets the measurement see what grows with the model.
    chunked = sys.modules[torchao_nf4().NF4Tensor.__module__]
    chunk_size, chunked.CHUNK_SIZE = chunked.CHUNK_SIZE, 1 << 16
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD fixed at 1 MiB: a freed tensor's pages go back to the kernel
    rises = {}
    try:
        for label, by_module in [("whole", False), ("by_module", True)]:  # torchao's imports come with the first
            torch.manual_seed(0)
            model = build_model({**section, "init_device": "meta"})
            if not by_module:
                model.init_steps = lambda: None
            libc.malloc_trim(0)  # freed heap memory back to the kernel: the baseline is real
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
            start = resident_kib("VmRSS")
            parallelize(model, FSDPConfig(), torch.device("cpu"), "fp32")
            rises[label] = (resident_kib("VmHWM") - start) * 1024
            del model
    finally:
        chunked.CHUNK_SIZE = chunk_size
    return rises if get_rank() == 0 else None


@pytest.mark.slow  # ~25 s on 2 shared cores
def test_rank_0s_host_memory_peak_is_its_shard_and_one_module_not_the_model(ranks):
    """QLoRA Llama whose bf16 base is 102 MB: initialised whole, rank 0's resident memory rises by more than that
    (205 MB: the bf16 values, their codes, the state dict read back); a module at a time, by less than a third
    of the whole init's rise (55 MB: its NF4 shard, 13 MB, one 1.6 MB module and ~40 MB of working memory that
    does not grow with the model)."""
    pytest.importorskip("torchao")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's resettable high-water mark (/proc/self/clear_refs)")
    peft_config = {"r": 4, "target_modules": "all-linear", "quantize_base": True, "base_dtype": "bfloat16"}
    shape = {"d_model": 512, "n_layers": 16, "n_heads": 8, "kv_n_heads": 4, "multiple_of": 256}
    section = {"name": "llama_causal_lm", **TINY_LLAMA, **shape, "peft_config": peft_config}
    rises = ranks.run(2, peak_host_bytes_of_placement, section)[0]
    from foundry.models.build import build_model

    bf16_bytes = 2 * sum(param.numel() for param in build_model({**section, "init_device": "meta"}).parameters())
    assert rises["whole"] > bf16_bytes, rises
    assert rises["by_module"] < rises["whole"] / 3, rises


def stream_pretrained(folder: str) -> dict | None:
    """On each rank: place a meta-device ``hf_causal_lm`` of ``folder`` whose whole-model load fails; rank 0 returns
    the full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from foundry.distributed import get_rank
    from foundry.distributed.config import FSDPConfig
    from foundry.distributed.placement import parallelize
    from foundry.distributed.process_group import init_process_group
    from foundry.models.build import build_model

    init_process_group()
    model = build_model({"name": "hf_causal_lm", "pretrained_model_name_or_path": folder, "init_device": "meta"})

    def whole_model() -> None:
        raise AssertionError("rank 0 read the whole model at once")

    model.init_weights = model.load_pretrained_weights = whole_model
    parallelize(model, FSDPConfig(), torch.device("cpu"), "fp32")
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return weights if get_rank() == 0 else None


def tiny_hf_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_pretrained_hugging_face_weights_stream_into_the_shards(ranks, tmp_path):
    """Each rank reads a 6-file checkpoint a layer at a time and keeps its slices: the pretrained weights."""
    pretrained = tiny_hf_llama()
    pretrained.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 4
    placed = ranks.run(2, stream_pretrained, str(tmp_path))[0]
    want = {f"hf_model.{name}": tensor for name, tensor in pretrained.state_dict().items()}
    assert placed.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(placed[name], tensor), name


def test_pretrained_weights_that_do_not_fit_are_named(ranks, tmp_path):
    from safetensors.torch import save_file

    pretrained = tiny_hf_llama()
    pretrained.config.save_pretrained(tmp_path)
    state = {name: tensor for name, tensor in pretrained.state_dict().items() if name != "lm_head.weight"}
    save_file({**state, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    unfit = r"none for \['hf_model.lm_head.weight'\], no parameter for \['hf_model.model.extra.weight'\]"
    with pytest.raises(RuntimeError, match=unfit):
        ranks.run(2, stream_pretrained, str(tmp_path))


def test_a_405b_llama_is_initialised_in_pieces_of_at_most_a_hundredth_of_it():
    """The shape of Llama 3.1 405B, on the meta device: the most a host holds whole while it is initialised."""
    from foundry.distributed.protocol import init_steps_of
    from foundry.models.build import build_model

    shape = {"d_model": 16384, "n_layers": 126, "n_heads": 128, "kv_n_heads": 8, "ffn_hidden_size": 53248}
    model = build_model({"name": "llama_causal_lm", **shape, "vocab_size": 128256, "init_device": "meta"})
    assert init_steps_of(model) is not None
    pieces = [sum(param.numel() for param in module.parameters(recurse=False)) for module in model.modules()]
    assert sum(pieces) > 400e9 and max(pieces) < sum(pieces) / 100

"""Pack/unpack and format round trips against hand-built examples of each documented layout."""
import pytest
import torch

from fitllm.quant.formats import autoawq, compressed_tensors, gptq
from fitllm.quant.formats.packing import AWQ_ORDER, pack_dim0, pack_dim1, to_kernel, unpack_dim0, unpack_dim1
from fitllm.quant.rtn import rtn_quantize
from fitllm.quant.scheme import QuantizedWeight, QuantScheme

from quant_fixtures import gptqmodel_v1_qzeros


def as_u32(x: torch.Tensor) -> int:
    return int(x) & 0xFFFFFFFF


def test_gptq_qweight_packs_k_low_bits_first():
    q = torch.arange(8).reshape(8, 1)  # column 0 holds k = 0..7
    assert as_u32(pack_dim0(q, 4)[0, 0]) == 0x76543210
    q8 = torch.tensor([[0x11], [0x22], [0x33], [0xF4]])
    assert as_u32(pack_dim0(q8, 8)[0, 0]) == 0xF4332211
    assert torch.equal(unpack_dim0(pack_dim0(q8, 8), 8), q8.int())
    assert pack_dim0(torch.full((8, 1), 15), 4)[0, 0] == -1  # all bits set: the int32 wraps


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_dim0_roundtrip_and_errors(bits):
    q = torch.randint(0, 1 << bits, (64, 24))
    assert torch.equal(unpack_dim0(pack_dim0(q, bits), bits), q.int())
    with pytest.raises(ValueError, match="rows"):
        pack_dim0(q[:63], bits)
    for bad in (-1, 1 << bits):  # would spill into a neighbour's bits
        with pytest.raises(ValueError, match="out of range"):
            pack_dim0(torch.where(q == q[3, 5], bad, q), bits)


def test_awq_interleaved_nibble_order():
    row = torch.arange(8).reshape(1, 8)  # columns 0..7 of one input row
    # AutoAWQ GEMM: slot j holds column (0, 2, 4, 6, 1, 3, 5, 7)[j]
    assert as_u32(pack_dim1(row, 4, AWQ_ORDER)[0, 0]) == 0x75316420
    assert torch.equal(unpack_dim1(torch.tensor([[0x75316420]], dtype=torch.int64).to(torch.int32), 4, AWQ_ORDER), row.int())


def test_gptq_zero_point_offset_and_g_idx():
    # 8 output columns, zero point 8 everywhere (symmetric): v1 stores 7s
    n, k = 8, 16
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    g_idx = torch.tensor([1, 0] * 8, dtype=torch.int32)  # act-order: interleaved groups
    qw = QuantizedWeight(q, torch.rand(n, 2) + 0.5, torch.full((n, 2), 8, dtype=torch.int32), 4, 8, True, g_idx)
    t = gptq.write(qw)
    assert as_u32(t["qzeros"][0, 0]) == 0x77777777
    assert torch.equal(t["g_idx"], g_idx)
    kw = gptq.read(t, {"bits": 4, "group_size": 8}, torch.float32)
    assert torch.equal(kw.zeros, torch.full((2, n), 8.0))
    assert torch.equal(kw.g_idx, g_idx)
    scales16 = qw.scale.half().float()
    expect = (q.float() - 8) * scales16[:, g_idx.long()]
    assert torch.equal(kw.dequantize(), expect)
    # gptq_v2 keeps the zero point as is
    v2 = dict(t, qzeros=pack_dim1(torch.full((2, n), 8), 4))
    assert torch.equal(gptq.read(v2, {"bits": 4, "group_size": 8, "checkpoint_format": "gptq_v2"}, torch.float32).zeros, kw.zeros)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_point_zero_as_gptqmodel_stores_it(bits):
    """GPTQModel packs the zero points as they are and exports v1 by taking 1 off each slot with one
    int32 subtraction per word, so a zero point of 0 (asymmetric) stores all ones and borrows from
    the next slot; reading slot by slot would give 2^bits and one less for its neighbour."""
    n, k, per = 16, 64, 32 // bits
    zero = torch.randint(1, 1 << bits, (2, n), dtype=torch.int32)  # [G, N]
    zero[0, 0] = zero[1, 3] = zero[1, per - 1] = 0  # the last slot of a word: its borrow falls off the word
    qzeros = gptqmodel_v1_qzeros(zero, bits)
    assert int(unpack_dim1(qzeros, bits)[0, 0]) == (1 << bits) - 1  # all ones, and slot 1 lost a 1
    assert int(unpack_dim1(qzeros, bits)[0, 1]) == (int(zero[0, 1]) - 2) % (1 << bits)
    q = torch.randint(0, 1 << bits, (k, n), dtype=torch.int32)
    scales = torch.rand(2, n).half() + 0.5
    t = {"qweight": pack_dim0(q, bits), "qzeros": qzeros, "scales": scales,
         "g_idx": torch.arange(k, dtype=torch.int32) // 32}
    kw = gptq.read(t, {"bits": bits, "group_size": 32, "sym": False}, torch.float32)
    assert torch.equal(kw.zeros, zero.float())
    expect = (q.float() - zero.float().repeat_interleave(32, 0)) * scales.float().repeat_interleave(32, 0)
    assert torch.equal(kw.dequantize(), expect.t())


def test_gptq_dynamic_rules_as_vllm_applies_them():
    """GPTQModel's `dynamic`: the first pattern matching the start of the name wins; `-:` leaves the
    module dense (None), `+:` or a bare pattern overrides bits / group_size / desc_act / sym only."""
    qc = {"bits": 4, "group_size": 128, "desc_act": True,
          "dynamic": {"-:model\\.layers\\.0\\.mlp": {}, "+:lm_head": {"bits": 8, "checkpoint_format": "x"},
                      r".*\.down_proj": {"group_size": 32}}}
    assert gptq.module_config(qc, "model.layers.0.mlp.up_proj") is None
    assert gptq.module_config(qc, "lm_head") == {**qc, "bits": 8}  # checkpoint_format is not overridable
    assert gptq.module_config(qc, "model.layers.1.mlp.down_proj")["group_size"] == 32
    assert gptq.module_config(qc, "model.layers.1.self_attn.q_proj") is qc
    assert gptq.module_config({"bits": 4}, "lm_head") == {"bits": 4}


def gptqmodel_loads_v1(qc: dict) -> bool:
    """The condition GPTQModel 7.7's loader puts on a `checkpoint_format: gptq` (v1) file, rewritten here
    from its behaviour: sym=True always loads; sym=False only if `meta.quantizer` (a list of
    "name:version") names gptqmodel, and the first such entry has a version >= 0.9.0. Otherwise it
    raises "Loading of a sym=False model with format=gptq is only supported if produced by gptqmodel
    version >= 0.9.0"."""
    from packaging.version import Version

    if qc.get("sym", True):
        return True
    entries = (qc.get("meta") or {}).get("quantizer") or []
    for name, _, ver in (e.partition(":") for e in ([entries] if isinstance(entries, str) else entries)):
        if name.lower() == "gptqmodel":
            return Version(ver) >= Version("0.9.0")
    return False


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_config_is_one_gptqmodel_loads(sym):
    """`--format gptq` configs GPTQModel's loader accepts: an asymmetric v1 file needs the producer
    list with the GPTQModel v1 convention (fitllm's zero points >= 1 are stored as its export stores
    them); fitllm names itself first and adds the convention only where GPTQModel asks for it."""
    import json

    from fitllm import __version__

    qc = json.loads(json.dumps(gptq.quantization_config(QuantScheme("gptq", sym=sym, act_order=True), 8)))
    assert gptqmodel_loads_v1(qc)
    assert qc["meta"]["quantizer"][0] == f"fitllm:{__version__}"
    assert ("gptqmodel:0.9.0" in qc["meta"]["quantizer"]) is (not sym)
    assert qc["checkpoint_format"] == "gptq" and qc["lm_head"] is True and qc["dynamic"] == {"+:lm_head": {"bits": 8}}
    assert not gptqmodel_loads_v1({**qc, "sym": False, "meta": {"quantizer": [f"fitllm:{__version__}"]}})


def test_autoawq_write_read_bit_identical():
    torch.manual_seed(0)
    scheme = QuantScheme("awq", group_size=32, scale_dtype=torch.float16)
    qw = rtn_quantize(torch.randn(64, 128), scheme)
    kw = autoawq.read(autoawq.write(qw), autoawq.quantization_config(scheme), torch.float32)
    assert torch.equal(kw.dequantize(), qw.dequantize())
    assert torch.equal(to_kernel(qw).qweight, kw.qweight)


def test_compressed_tensors_hand_built_and_round_trip():
    # unsigned 1..8 are signed -7..0; the package packs value+8 along K, low bits first
    qw = QuantizedWeight(torch.arange(1, 9, dtype=torch.uint8).repeat(8, 1), torch.ones(8, 1),
                         torch.full((8, 1), 3, dtype=torch.int32), 4, -1, False)
    t = compressed_tensors.write(qw)
    assert as_u32(t["weight_packed"][0, 0]) == 0x87654321
    assert as_u32(t["weight_zero_point"][0, 0]) == 0x33333333  # zero points packed along N
    torch.manual_seed(1)
    for sym in (False, True):
        scheme = QuantScheme("rtn", group_size=32, sym=sym)
        qw = rtn_quantize(torch.randn(24, 96), scheme)
        group = compressed_tensors.quantization_config(scheme)["config_groups"]["group_0"]
        kw = compressed_tensors.read(compressed_tensors.write(qw), group, torch.float32)
        assert torch.equal(kw.dequantize(), qw.dequantize())


def test_compressed_tensors_fp8_round_trip():
    from fitllm.quant.fp8 import fp8_quantize

    w = torch.randn(16, 32)
    f = fp8_quantize(w)
    scheme = QuantScheme("fp8")
    group = compressed_tensors.quantization_config(scheme)["config_groups"]["group_0"]
    back = compressed_tensors.read(compressed_tensors.write(f), group, torch.float32)
    assert torch.equal(back.dequantize(), f.dequantize())
    assert (f.dequantize() - w).abs().max() / w.abs().max() < 0.07


def test_kernel_layout_matches_kernels_module():
    """fitllm's repack target is exactly what fitllm.kernels.w4a16 consumes."""
    w4a16 = pytest.importorskip("fitllm.kernels.w4a16")
    torch.manual_seed(2)
    qw = rtn_quantize(torch.randn(16, 64), QuantScheme("rtn", group_size=32))
    kw = to_kernel(qw)
    assert torch.allclose(w4a16.dequantize_packed(kw.qweight, kw.scales, kw.zeros, kw.group_size), qw.dequantize().t())
    x = torch.randn(3, 64)
    ref = x @ qw.dequantize().t()
    assert torch.allclose(w4a16.w4a16_gemm(x, kw.qweight, kw.scales, kw.zeros, kw.group_size), ref, atol=1e-5)


def test_gptq_dynamic_exclusions_build_dense_layers():
    from fitllm.models.errors import ModelLoadError
    from fitllm.models.linear import DenseLinear
    from fitllm.quant.layers import QuantLinear, quant_factory

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True,
          "dynamic": {r"-:model\.layers\.1\.mlp": {}, r"-:model\.layers\.2\.self_attn\.q_proj": {}}}
    make = quant_factory(qc, torch.float32, "cpu")
    assert make.quantizes_lm_head
    assert isinstance(make("model.layers.1.mlp.gate_up_proj", 64, [128, 128], False), DenseLinear)
    assert isinstance(make("model.layers.0.mlp.gate_up_proj", 64, [128, 128], False), QuantLinear)
    assert isinstance(make("lm_head", 64, [1000], False), QuantLinear)
    with pytest.raises(ModelLoadError, match="fuses quantized and unquantized"):
        make("model.layers.2.self_attn.qkv_proj", 64, [64, 32, 32], False)
    quant_factory({**qc, "pack_dtype": "int32"}, torch.float32, "cpu")  # what GPTQModel writes by default
    with pytest.raises(ModelLoadError, match="pack_dtype 'int16' is not supported"):
        quant_factory({**qc, "pack_dtype": "int16"}, torch.float32, "cpu")

"""A safetensors folder as the streamed loader reads it (engine/weights/safetensors_folder.py): the values safetensors'
own loader gives, bad files refused in one line, and no file pages left in the process's resident memory."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.weights.safetensors_folder import SafetensorsFolder
from conftest import require_op


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, 3, generator=generator)
    return {
        "model.embed_tokens.weight": base.to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": base[:, :, 0].to(torch.float16),
        "model.norm.weight": base[0, :, 0].clone(),
        "model.rotary.inv_freq": base[0, 0, 0].clone(),  # a scalar
        "position_ids": torch.arange(11, dtype=torch.int64),
    }


def test_every_tensor_reads_as_safetensors_own_loader_gives_it_whole_and_by_rows(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"lm_head.weight": tensors["model.embed_tokens.weight"] * 2},
              tmp_path / "model-00002-of-00002.safetensors")
    expected = {**load_file(tmp_path / "model-00001-of-00002.safetensors"),
                **load_file(tmp_path / "model-00002-of-00002.safetensors")}
    folder = SafetensorsFolder(tmp_path)
    assert sorted(folder.names()) == sorted(expected)
    for name, tensor in expected.items():
        assert folder.shape(name) == tuple(tensor.shape)
        assert folder.float(name).dtype == torch.float32
        assert torch.equal(folder.float(name), tensor.float()), name
        if tensor.dim():
            rows = list(folder.float_rows(name, rows=3))
            assert [r.shape[0] for r in rows] == [min(3, tensor.shape[0] - s) for s in range(0, tensor.shape[0], 3)]
            assert torch.equal(torch.cat(rows), tensor.float()), name
    assert folder.type_name("model.embed_tokens.weight") == "BF16"
    assert folder.type_name("model.layers.0.mlp.up_proj.weight") == "F16"


@pytest.mark.parametrize("damage", ["cut in the data", "cut in the header", "not safetensors", "huge header"])
def test_a_damaged_file_is_one_clear_error_naming_it(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    data = path.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    damaged = {"cut in the data": data[:header_end + 16], "cut in the header": data[:header_end - 5],
               "not safetensors": b"GGUF" + data[4:],
               "huge header": (1 << 40).to_bytes(8, "little") + data[8:]}[damage]
    path.write_bytes(damaged)
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        SafetensorsFolder(tmp_path)


def _resident_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("this kernel reports no RssFile")


def test_reading_a_folder_leaves_none_of_its_files_pages_resident_in_the_process(tmp_path):
    """An 8B bf16 folder read through mapped files held ~9 GB of their pages resident until the load ended (18 GB
    at its peak where 9.3 GB was the bound); read into memory of the loader's own, the files' pages stay out of
    the process (in the page cache, which the kernel reclaims freely)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc")
    save_file({"small": torch.zeros(4, 4, dtype=torch.bfloat16)}, tmp_path / "warm.safetensors")
    warm = tmp_path / "warm"
    warm.mkdir()
    (tmp_path / "warm.safetensors").rename(warm / "model.safetensors")
    list(SafetensorsFolder(warm).float_rows("small"))  # whatever the first read imports or maps, before measuring

    big = tmp_path / "big"
    big.mkdir()
    matrix = torch.ones(12_288, 4_096, dtype=torch.bfloat16)  # 96 MiB of file
    save_file({"model.embed_tokens.weight": matrix}, big / "model.safetensors")
    del matrix
    folder = SafetensorsFolder(big)
    before = _resident_file_kib()
    total = 0.0
    for rows in folder.float_rows("model.embed_tokens.weight"):
        total += float(rows[:, 0].sum())
    grown_mib = (_resident_file_kib() - before) / 1024
    assert total == 12_288
    assert grown_mib < 16, f"{grown_mib:.0f} MiB of the 96 MiB file stayed resident in the process"


@pytest.mark.parametrize("layout", ["q8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_folders_matrix_by_the_kernels_repacking_gives_the_float_paths_bytes(layout, dtype, path_kernels,
                                                                               tmp_path, monkeypatch):
    """Where a kernel path is built the folder's float rows go into q8 or int4 in one C++ pass
    (CpuKernels.gguf_repack), several chunks of rows for a big matrix, into a new tensor or the fused layer's `out`;
    without it through float32 and quant.pack_q8 / quant.pack_int4. The same bytes either way, blocks of one value
    (a zero step) and of evenly spaced levels included."""
    from engine.weights import quant, safetensors_folder

    repack = require_op(path_kernels.gguf_repack, "GGUF repacking")
    monkeypatch.setattr(safetensors_folder, "_ROWS_PER_READ", 16)  # 40 rows: three chunks, the last a part one
    weight = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[2, :32] = 0.25
    weight[5, 32:64] = -0.5 + torch.arange(32) % 16 * 0.0625
    weight = weight.to(dtype)
    save_file({"w": weight}, tmp_path / "model.safetensors")
    folder = SafetensorsFolder(tmp_path)
    quantized = getattr(folder, layout)
    expected = quant.PACK_FROM_FLOAT[layout](weight.float())
    assert torch.equal(quantized("w"), expected)
    assert torch.equal(quantized("w", repack=repack), expected)
    out = torch.zeros(48, expected.shape[1], dtype=torch.uint8)
    quantized("w", repack=repack, out=out[8:])
    assert torch.equal(out[8:], expected) and not out[:8].any()

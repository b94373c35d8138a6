"""training/metrics.py: the MFU peak is the one of the exact GPU model (PCIe and NVL cards run lower)."""
import logging

import pytest
import torch

from training.metrics import match_peak, peak_flops, peak_info

NAMES = {  # torch.cuda.get_device_name() -> dense bf16 TFLOP/s
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA H20": 148.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L4": 121.0,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_peak_of_each_device_name(name):
    assert match_peak(name)[1] == NAMES[name]


def test_unknown_gpu_has_no_peak_and_run_info_says_which_peak(monkeypatch, caplog):
    assert match_peak("Some Future GPU") is None
    assert peak_info(torch.device("cpu"))["mfu_peak_tflops_per_gpu"] is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda) == 756e12
    assert peak_info(cuda) == {"device_name": "NVIDIA H100 PCIe", "mfu_peak_key": "H100 PCIe",
                               "mfu_peak_tflops_per_gpu": 756.0}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    with caplog.at_level(logging.WARNING, logger="training.metrics"):
        assert peak_flops(cuda) is None
    assert "no peak FLOP/s known for 'Some Future GPU'" in caplog.text
    assert peak_info(cuda)["mfu_peak_key"] is None

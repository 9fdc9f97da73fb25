"""`lit_memory.confine.gpu`: the parent makes ``/dev/nvidia-uvm`` for a confined run, or says in one line why the GPU
cannot start. Driven with a fake ``/dev`` folder and a fake ``nvidia-modprobe``: no GPU needed."""

from __future__ import annotations

import subprocess

from lit_memory.confine import gpu


def test_the_parent_makes_the_uvm_device_or_says_why_the_gpu_cannot_start(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    calls = []

    def modprobe(args, **kwargs):  # as nvidia-modprobe -u -c=0 does: the device files appear
        calls.append(args)
        (dev / "nvidia-uvm").touch()
        return subprocess.CompletedProcess(args, 0)

    assert gpu.uvm(dev, modprobe, lambda name: f"/usr/bin/{name}") is None and not calls  # no NVIDIA driver
    (dev / "nvidiactl").touch()
    assert gpu.uvm(dev, modprobe, lambda name: f"/usr/bin/{name}") is None
    assert calls == [["/usr/bin/nvidia-modprobe", "-u", "-c=0"]] and (dev / "nvidia-uvm").exists()
    assert gpu.uvm(dev, modprobe, lambda name: "/usr/bin/x") is None and len(calls) == 1  # there: nothing run
    (dev / "nvidia-uvm").unlink()
    line = gpu.uvm(dev, modprobe, lambda name: None)
    assert line.startswith("warning: sandbox: the GPU cannot start confined") and "not installed" in line
    assert "\n" not in line and len(calls) == 1
    line = gpu.uvm(dev, lambda args, **kwargs: subprocess.CompletedProcess(args, 1), lambda name: "/sbin/nm")
    assert "/sbin/nm -u -c=0 did not make it" in line

    def broken(args, **kwargs):
        raise PermissionError("not allowed")

    assert "failed (not allowed)" in gpu.uvm(dev, broken, lambda name: "/sbin/nm")

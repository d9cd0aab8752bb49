"""Shared-memory lifecycle, the buffer pool, and the configuration's validation."""
import gc
import hashlib
import os
from pathlib import Path

import pytest
import torch

from fasthorovod import _C
from fasthorovod.config import ALIASES, Config, ConfigError
from fasthorovod.exceptions import FastHorovodError
from fasthorovod.proxy.buffers import LEND_MIN_BYTES, BufferPool, copy_tensor, size_class, zero_tensor


def _memfd_fds():
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fasthorovod"):
                fds.append(fd)
        except FileNotFoundError:  # the directory's own descriptor, closed since
            pass
    return fds


def _memfd_mappings():
    with open("/proc/self/maps") as maps:
        return sum("/memfd:fasthorovod" in line for line in maps)


def test_segments_have_no_name_and_their_views_outlive_them():
    fds, mappings = _memfd_fds(), _memfd_mappings()
    seg = _C.ShmBuffer(4096)
    assert seg.nbytes == 4096 and not hasattr(seg, "unlink")
    assert _memfd_fds() == fds  # only the mapping holds the memory
    view = torch.frombuffer(seg, dtype=torch.uint8)
    assert int(view.sum()) == 0
    view.fill_(7)
    del seg
    assert int(view.sum()) == 7 * 4096  # the mapping lives as long as a view
    del view
    assert _memfd_mappings() == mappings


def test_a_buffer_larger_than_the_memory_left_raises_naming_the_shortage():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    with pytest.raises(FastHorovodError, match=r"not enough memory for a .* buffer: it needs .* of shared "
                                               r"memory but only .* is free .*raise the memory limit"):
        _C.ShmBuffer(2 * total)  # refused before anything is allocated
    assert int(torch.frombuffer(_C.ShmBuffer(1 << 20), dtype=torch.uint8).sum()) == 0  # and nothing broke


def test_pool_recycles_by_size_class_and_locates_persistent_views():
    created = []
    pool = BufferPool(lambda buffer_id, nbytes: created.append((buffer_id, nbytes)) or _C.ShmBuffer(nbytes))
    a = pool.acquire(100_000)
    assert a.nbytes == size_class(100_000) == 131072 and created == [(0, 131072)]
    pool.release(a)
    assert pool.acquire(70_000) is a
    persistent = pool.register(4096)
    assert created[-1] == (1, 4096)
    view = persistent.view(torch.float32, 1024, 256)
    assert pool.locate(view) == (persistent, 1024)
    assert pool.locate(torch.zeros(4)) is None
    pool.close()
    view.fill_(1.0)  # still mapped after close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8,
                                   torch.bool, torch.complex64])
def test_staging_copies_match_torch_for_every_layout(dtype):
    pool = BufferPool()
    buf = pool.acquire((1 << 22) + 64)  # above the size at which the copy releases the GIL
    gen = torch.Generator().manual_seed(0)
    src = (torch.randn(1 << 19, generator=gen) * 100).to(dtype) if dtype != torch.complex64 \
        else torch.randn(1 << 19, dtype=dtype, generator=gen)
    staging = buf.view(dtype, 64, src.numel())
    copy_tensor(staging, src)  # the plain path: one memory copy
    assert torch.equal(staging, src)
    zero_tensor(staging)
    assert not staging.any()
    copy_tensor(staging[:100], src[::2][:100])  # a strided source: torch's copy
    assert torch.equal(staging[:100], src[::2][:100])
    if dtype.is_complex:  # a conjugate view is contiguous, but its memory is not its values
        copy_tensor(staging, src.conj())
        assert torch.equal(staging, src.conj())
    before = buf.view(torch.uint8, 0, 64).clone()
    copy_tensor(staging[:0], src[:0])  # nothing to copy; nothing before the view touched
    assert torch.equal(buf.view(torch.uint8, 0, 64), before)
    pool.release(buf)


def test_staging_copies_from_a_tensor_that_requires_grad_record_nothing():
    pool = BufferPool()
    buf = pool.acquire(1 << 16)
    src = torch.ones(8, requires_grad=True)
    staging = buf.view(torch.float32, 0, 8)
    copy_tensor(staging, src)
    assert not staging.requires_grad and staging.grad_fn is None and torch.equal(staging, src.detach())
    copy_tensor(staging, (src * 2)[::1].t())  # still plain, a non-leaf
    assert torch.equal(staging, torch.full((8,), 2.0))
    pool.release(buf)


def test_size_classes():
    assert size_class(1) == 1 << 16
    assert size_class(700_000) == 1 << 20
    assert size_class((1 << 20) + 1) == 5 << 18  # quarters above 1 MiB
    assert size_class(5 << 20) == 5 << 20 and size_class((5 << 20) + 1) == 6 << 20
    assert size_class((100 << 20) + 5) == 112 << 20
    for nbytes in (LEND_MIN_BYTES, LEND_MIN_BYTES + 1, 3 << 20, (64 << 20) + 1, 10 ** 9):
        assert nbytes <= size_class(nbytes) <= nbytes * 5 // 4 + 1  # what a lent output may keep


def test_a_lent_buffer_returns_to_the_pool_when_its_last_tensor_is_gone():
    pool = BufferPool()
    buf = pool.acquire(3 << 20)
    buf.view(torch.float32, 0, 6).copy_(torch.arange(6.0))
    a, b, empty = pool.lend(buf, [(0, torch.float32, (2, 3)), (1 << 20, torch.int64, (4,)), (64, torch.float32, (0, 5))])
    assert torch.equal(a, torch.arange(6.0).view(2, 3)) and a._base is None and a.is_contiguous()
    assert a.untyped_storage().nbytes() == 24 and empty.shape == (0, 5)
    b.fill_(7)
    assert torch.equal(buf.view(torch.int64, 1 << 20, 4), torch.full((4,), 7))  # the buffer's own bytes
    row = a[1]
    del a
    gc.collect()
    assert pool.acquire(3 << 20) is not buf  # a view of one piece and the other piece hold it
    del b
    gc.collect()
    assert pool.acquire(3 << 20) is not buf
    del row
    gc.collect()
    assert pool.acquire(3 << 20) is buf
    pool.close()
    kept, = BufferPool().lend(BufferPool().acquire(1 << 20), [(0, torch.uint8, (8,))])
    kept.fill_(1)  # a pool gone does not unmap what it lent


def test_config_defaults_and_errors():
    cfg = Config.from_env({})
    # what the user did not set stays unset (the data plane's plan decides it: test_plan.py)
    assert cfg.num_lanes is None and cfg.sockets_per_lane is None and cfg.proxy_threshold_bytes is None
    assert cfg.probe == "auto" and cfg.hierarchical == "auto"
    assert Config.from_env({"FASTHOROVOD_NUM_LANES": " "}).num_lanes is None  # blank is unset
    assert Config.from_env({"FASTHOROVOD_SOCKETS_PER_LANE": "3"}).sockets_per_lane == 3
    with pytest.raises(ConfigError, match="FASTHOROVOD_SOCKETS_PER_LANE=65 must be in"):
        Config.from_env({"FASTHOROVOD_SOCKETS_PER_LANE": "65"})
    with pytest.raises(ConfigError, match="FASTHOROVOD_PROBE='yes' must be one of auto, 0, 1"):
        Config.from_env({"FASTHOROVOD_PROBE": "yes"})
    assert Config.from_env({"FASTHOROVOD_NUM_LANES": "2"}).num_lanes == 2
    with pytest.raises(ConfigError, match="FASTHOROVOD_NUM_LANES='two' is not an integer"):
        Config.from_env({"FASTHOROVOD_NUM_LANES": "two"})
    with pytest.raises(ConfigError, match="FASTHOROVOD_NUM_LANES=65 must be in"):
        Config.from_env({"FASTHOROVOD_NUM_LANES": "65"})
    with pytest.raises(ConfigError, match="FASTHOROVOD_TIMEOUT_SECONDS=0.0 must be > 0"):
        Config.from_env({"FASTHOROVOD_TIMEOUT_SECONDS": "0"})
    assert (cfg.bucket_bytes, cfg.first_bucket_bytes) == (25 << 20, 1 << 20)
    assert Config.from_env({"FASTHOROVOD_FIRST_BUCKET_BYTES": "4096"}).first_bucket_bytes == 4096
    with pytest.raises(ConfigError, match="FASTHOROVOD_FIRST_BUCKET_BYTES=0 must be >= 1"):
        Config.from_env({"FASTHOROVOD_FIRST_BUCKET_BYTES": "0"})
    a = Config.from_env({"FASTHOROVOD_NUM_LANES": "2"})
    assert a.wire_hash() != Config.from_env({}).wire_hash()
    assert a.wire_hash() == Config.from_env({"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": "5"}).wire_hash()
    assert Config.from_env({"FASTHOROVOD_PROBE": "0"}).wire_hash() != Config.from_env({}).wire_hash()
    # set to the default is not unset: a rank that set it and one that did not may plan differently
    assert Config.from_env({"FASTHOROVOD_NUM_LANES": "4"}).wire_hash() != Config.from_env({}).wire_hash()


def test_the_lane_settings_former_names_are_still_read():
    """FASTHOROVOD_NUM_PROXIES and FASTHOROVOD_SOCKETS_PER_PROXY are the former names of
    FASTHOROVOD_NUM_LANES and FASTHOROVOD_SOCKETS_PER_LANE (docs/env.md)."""
    assert ALIASES == {"FASTHOROVOD_NUM_LANES": "FASTHOROVOD_NUM_PROXIES",
                       "FASTHOROVOD_SOCKETS_PER_LANE": "FASTHOROVOD_SOCKETS_PER_PROXY"}
    old = Config.from_env({"FASTHOROVOD_NUM_PROXIES": "3", "FASTHOROVOD_SOCKETS_PER_PROXY": "2"})
    new = Config.from_env({"FASTHOROVOD_NUM_LANES": "3", "FASTHOROVOD_SOCKETS_PER_LANE": "2"})
    assert (old.num_lanes, old.sockets_per_lane) == (3, 2) and old == new
    assert old.wire_hash() == new.wire_hash()  # a rank using either name connects to the other
    assert Config.from_env({"FASTHOROVOD_NUM_PROXIES": "0"}).num_lanes == 0
    # both names, the same value (however written): fine; a blank one is unset
    both = {"FASTHOROVOD_NUM_LANES": "8", "FASTHOROVOD_NUM_PROXIES": " 0x8 ",
            "FASTHOROVOD_SOCKETS_PER_LANE": "", "FASTHOROVOD_SOCKETS_PER_PROXY": "4"}
    assert (Config.from_env(both).num_lanes, Config.from_env(both).sockets_per_lane) == (8, 4)
    # a bad value's error names the variable that holds it
    with pytest.raises(ConfigError, match="^FASTHOROVOD_NUM_PROXIES='two' is not an integer$"):
        Config.from_env({"FASTHOROVOD_NUM_PROXIES": "two"})
    with pytest.raises(ConfigError, match="^FASTHOROVOD_SOCKETS_PER_PROXY=0 must be in \\[1, 64\\]$"):
        Config.from_env({"FASTHOROVOD_SOCKETS_PER_PROXY": "0"})
    with pytest.raises(ConfigError, match="^FASTHOROVOD_NUM_PROXIES=65 must be in"):
        Config.from_env({"FASTHOROVOD_NUM_LANES": "4", "FASTHOROVOD_NUM_PROXIES": "65"})


@pytest.mark.parametrize("new, old", sorted(ALIASES.items()))
def test_a_setting_and_its_former_name_set_to_different_values_is_an_error(new, old):
    with pytest.raises(ConfigError) as err:
        Config.from_env({new: "2", old: "3"})
    assert str(err.value) == (f"{new}=2 and {old}=3 disagree ({old} is the former name of {new}); "
                              "set only one of them")


def test_the_wire_hash_is_over_the_values_the_ranks_must_share():
    """The wire hash is over the values, not the field names: (lanes, sockets per lane, probe,
    threshold, segment bytes, rebalance period, hierarchical, the re-hash warm-up, which every rank
    runs or none, and re-hashing, on which the probe's choice of sockets per lane counts)."""
    cfg = Config.from_env({"FASTHOROVOD_NUM_LANES": "3", "FASTHOROVOD_SOCKETS_PER_LANE": "2",
                           "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0", "FASTHOROVOD_HIERARCHICAL": "0"})
    shared = (3, 2, "auto", 0, 1 << 20, 1, "0", "auto", True)
    expected = int.from_bytes(hashlib.sha256(repr(shared).encode()).digest()[:8], "little")
    assert cfg.wire_hash() == expected
    assert Config.from_env({"FASTHOROVOD_SOCKETS_PER_LANE": "2"}).wire_hash() != Config.from_env({}).wire_hash()
    assert Config.from_env({"FASTHOROVOD_REHASH_WARM_UP": "0"}).wire_hash() != Config.from_env({}).wire_hash()
    assert Config.from_env({"FASTHOROVOD_REHASH": "0"}).wire_hash() != Config.from_env({}).wire_hash(), \
        "every rank must choose the same sockets per lane, and the choice depends on it"


def test_proxies_start_the_workers_package_even_from_a_shadowing_directory(tmp_path):
    """A worker's current directory holding a 'fasthorovod' package (e.g. a checkout of another
    version) must not be what its proxies import."""
    import subprocess

    from fasthorovod.proxy import startup as pg

    shadow = tmp_path / "fasthorovod"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing copy was imported')\n")
    argv = pg.proxy_command(9, 3)
    assert argv[-4:] == ["-m", "fasthorovod.proxy", "9", "3"]
    probe = argv[:-4] + ["-c", "import fasthorovod.proxy.__main__, fasthorovod; print(fasthorovod.__file__)"]
    out = subprocess.run(probe, cwd=tmp_path, env=pg.proxy_environment(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(Path(pg.__file__).resolve().parents[1] / "__init__.py")


def test_stall_settings_follow_horovods_variables_unless_ours_are_set():
    assert (Config.from_env({}).stall_check_seconds, Config.from_env({}).stall_shutdown_seconds) == (60.0, 0.0)
    horovod = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}
    assert (Config.from_env(horovod).stall_check_seconds, Config.from_env(horovod).stall_shutdown_seconds) == (5, 30)
    ours = dict(horovod, FASTHOROVOD_STALL_CHECK_SECONDS="2", FASTHOROVOD_STALL_SHUTDOWN_SECONDS="0")
    assert (Config.from_env(ours).stall_check_seconds, Config.from_env(ours).stall_shutdown_seconds) == (2, 0)
    assert Config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_check_seconds == 0
    assert Config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "FASTHOROVOD_STALL_CHECK_SECONDS": "9"}
                           ).stall_check_seconds == 9
    with pytest.raises(ConfigError, match="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=-1.0 must be >= 0"):
        Config.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "-1"})
    with pytest.raises(ConfigError, match="FASTHOROVOD_STALL_CHECK_SECONDS='soon' is not a number"):
        Config.from_env({"FASTHOROVOD_STALL_CHECK_SECONDS": "soon"})

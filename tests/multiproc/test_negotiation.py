"""Negotiated collectives with real ranks and proxies: any order, any thread, mismatches that
leave the job working, the stall inspector, and join with several sockets per proxy."""
import re

import pytest
import torch

from tests.multiproc.harness import REPO, run_job

pytestmark = [pytest.mark.multiproc]
WORKER = str(REPO / "tests" / "workers" / "negotiation_worker.py")


@pytest.mark.parametrize("np_, threads", [(3, 1), (4, 1), (3, 4), (4, 2)])
def test_permuted_order_and_threads_give_exact_results(np_, threads):
    result = run_job(np_, "permuted", "--count", "32", "--threads", str(threads), "--seed", str(np_ + threads),
                     worker=WORKER, timeout=600, env={"FASTHOROVOD_NUM_PROXIES": "2"})
    assert result.stdout.count("permuted ok") == np_, result.stdout[-3000:]


def test_grouped_allreduces_in_permuted_order():
    result = run_job(3, "grouped", worker=WORKER, env={"FASTHOROVOD_NUM_PROXIES": "2"})
    assert result.stdout.count("grouped ok") == 3, result.stdout[-3000:]


def test_stall_is_reported_with_the_missing_rank():
    result = run_job(2, "stall", "--delay", "2.5", worker=WORKER,
                     env={"FASTHOROVOD_NUM_PROXIES": "2", "FASTHOROVOD_STALL_CHECK_SECONDS": "1"})
    warnings = re.findall(r"stall: tensor 'stall\.late' was submitted by ranks \[0\].*waiting for ranks \[1\]",
                          result.stdout)
    assert len(warnings) == 1, result.stdout[-3000:]  # reported once


def test_stall_shutdown_fails_the_tensor_and_the_job_goes_on():
    result = run_job(2, "stall", "--delay", "0", "--shutdown", worker=WORKER,
                     env={"FASTHOROVOD_NUM_PROXIES": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    assert "stalled tensor failed" in result.stdout and result.stdout.count("stall ok") == 2, result.stdout[-3000:]


@pytest.mark.parametrize("scenario, args", [("join", ()), ("join_order", ("--count", "20"))])
def test_join_with_two_sockets_per_proxy(scenario, args):
    result = run_job(3, scenario, *args, timeout=400,
                     env={"FASTHOROVOD_NUM_PROXIES": "2", "FASTHOROVOD_SOCKETS_PER_PROXY": "2",
                          "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0"})
    assert result.returncode == 0


def test_dynamic_forward_and_hook_order_match_horovod_step_by_step(tmp_path):
    """Two ranks, so that each sum has one rounding whatever the order: bit-identical to Horovod."""
    ours, theirs = tmp_path / "fasthorovod.pt", tmp_path / "horovod.pt"
    result = run_job(2, "dynamic", "--out", str(ours), worker=WORKER,
                     env={"FASTHOROVOD_NUM_PROXIES": "2", "FASTHOROVOD_BUCKET_BYTES": str(1 << 20)})
    assert "proxies=True" in result.stdout, result.stdout[-2000:]
    run_job(2, "dynamic", "--out", str(theirs), "--module", "horovod.torch", worker=WORKER)
    a, b = torch.load(ours), torch.load(theirs)
    for step, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max()}"

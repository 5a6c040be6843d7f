"""The sockets a parallel engine listens on: on one machine (the mp executor) every listener of rank 0
and of its workers is bound to loopback, never to every interface (torch's store, gloo's pairs)."""

from __future__ import annotations

import os
import sys

import pytest

from moetier.dist.group import LOOPBACK, address, local_rendezvous, release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")


def listening() -> dict[int, str]:
    """Socket inode -> "addr:port" of every listening TCP socket on this machine (/proc/net/tcp, tcp6)."""
    out = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], int(f[9])
            if state != "0A":  # LISTEN
                continue
            hexaddr, port = local.split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                import ipaddress
                addr = str(ipaddress.IPv6Address(raw))
            else:
                addr = ".".join(str(b) for b in raw[::-1])
            out[inode] = f"{addr}:{int(port, 16)}"
    return out


def sockets_of(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def listeners_of(pids: list[int]) -> list[str]:
    table = listening()
    return sorted(table[i] for pid in pids for i in sockets_of(pid) if i in table)


def is_loopback(where: str) -> bool:
    addr = where.rpartition(":")[0]
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


def test_the_rendezvous_socket_is_bound_to_loopback_before_any_rank_starts():
    rdv = local_rendezvous(2, "cpu", 5.0)
    try:
        host, port = address(rdv)
        assert host == LOOPBACK
        assert f"{LOOPBACK}:{port}" in listeners_of([os.getpid()])
    finally:
        release(rdv)
    assert all(not w.endswith(f":{port}") for w in listeners_of([os.getpid()]))


def test_a_two_rank_engine_listens_on_loopback_only(tiny_ckpt):
    from moetier.engine.llm import LLM
    from moetier.sampling_params import SamplingParams

    before = set(listeners_of([os.getpid()]))
    llm = LLM(tiny_ckpt, device="cpu", kv_tokens=128, page_size=16, max_num_seqs=2, tensor_parallel_size=2,
              dist_timeout_s=60.0)
    try:
        out = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
        pids = [os.getpid(), *(p.pid for p in llm._workers.processes)]
        now = listeners_of(pids)
        new = [w for w in now if w not in before]
        assert new, "the group made no listener (the check would see nothing)"
        assert all(is_loopback(w) for w in now), now
    finally:
        llm.close()

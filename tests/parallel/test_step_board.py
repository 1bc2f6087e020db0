"""The step board (parallel/step_board.py): every rank's row reaches every rank in rank order, and a rank that
leaves, hangs or sends a different row fails its peers' round rather than leaving them waiting, on one host (Unix
sockets), with every rank on a host of its own (TCP to rank 0, loopback here) and with two ranks per host (each
host's leader gathers its rows over a Unix socket and meets rank 0 over TCP). Ranks are threads here, each with its
own sockets and a host id it is told, meeting in one in-process store."""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from meshserve.parallel.step_board import StepBoard
from meshserve.utils import cluster_auth

MEET_S = 10.0


LAYOUTS = {  # name: (rank 0's TCP address or None on one host, the host id of a rank)
    "unix": (None, None),
    "tcp": ("127.0.0.1", lambda rank: f"host-{rank}"),
    "two-per-host": ("127.0.0.1", lambda rank: f"host-{rank // 2}"),
}


@pytest.fixture(params=list(LAYOUTS))
def host(request) -> str:
    """How the ranks are laid out on hosts (a LAYOUTS name)."""
    return request.param


def open_boards(world: int, host: str, round_timeout_s: float = 5.0, generation: int = 1,
                store: dist.Store | None = None) -> list[StepBoard]:
    store = store or dist.HashStore()
    address, host_id = LAYOUTS[host]
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(StepBoard.open, store, rank, world, generation, round_timeout_s, MEET_S, address,
                               host_id and host_id(rank)) for rank in range(world)]
        return [future.result(timeout=MEET_S) for future in futures]


def exchange_all(boards: list[StepBoard], rows: list[list[int]]) -> list:
    """Each rank's table, or the exception its round raised."""
    def one(board: StepBoard, row: list[int]):
        try:
            return board.exchange(row)
        except Exception as exc:  # noqa: BLE001 - the test looks at which
            return exc

    with ThreadPoolExecutor(len(boards)) as pool:
        return list(pool.map(one, boards, rows))


def close_all(boards: list[StepBoard]) -> None:
    for board in boards:
        board.close()


def test_every_rank_reads_every_row_in_rank_order_round_after_round(host):
    boards = open_boards(4, host)
    try:
        for round_ in range(20):
            rows = [[rank, round_, -rank * round_, 2**40 + rank, 0] for rank in range(4)]
            tables = exchange_all(boards, rows)
            assert tables == [rows] * 4
    finally:
        close_all(boards)


def test_a_rank_that_leaves_fails_the_round_of_every_other_at_once(host):
    boards = open_boards(3, host)
    try:
        boards[2].close()  # what a killed rank's process does to its connection
        t0 = time.monotonic()
        results = exchange_all(boards[:2], [[0, 1], [1, 1]])
        assert all(isinstance(result, ConnectionError) for result in results), results
        assert time.monotonic() - t0 < 4.0  # well before the round's 5 s timeout
    finally:
        close_all(boards)


def test_a_rank_that_hangs_fails_the_round_after_the_timeout(host):
    boards = open_boards(3, host, round_timeout_s=0.3)
    try:
        results = exchange_all(boards[:2], [[0], [1]])  # rank 2 never comes
        # rank 0 times out waiting for rank 2; rank 1 either times out too or sees rank 0 close the board
        assert isinstance(results[0], TimeoutError) and isinstance(results[1], OSError), results
        with pytest.raises(ConnectionError, match="closed"):
            boards[0].exchange([0])
    finally:
        close_all(boards)


def test_rows_of_different_lengths_are_an_error_not_a_wrong_table(host):
    boards = open_boards(2, host)
    try:
        results = exchange_all(boards, [[0, 1, 2], [1, 2]])
        assert isinstance(results[0], ConnectionError) and "rows differ" in str(results[0])
    finally:
        close_all(boards)


def test_each_generation_meets_on_its_own_address(host):
    store = dist.HashStore()
    first = open_boards(2, host, store=store, generation=1)
    second = open_boards(2, host, store=store, generation=2)  # what a rebuild after a rollback opens
    try:
        where = "tcp" if host == "tcp" else "unix/0"  # rank 0's listener: for other hosts, or its own host's ranks
        assert store.get(f"meshserve/step-board/1/{where}") != store.get(f"meshserve/step-board/2/{where}")
        assert exchange_all(second, [[7], [8]]) == [[[7], [8]]] * 2
        assert exchange_all(first, [[1], [2]]) == [[[1], [2]]] * 2
    finally:
        close_all(first + second)


def test_one_rank_needs_no_connection():
    board = StepBoard.open(dist.HashStore(), 0, 1, 1, 1.0, MEET_S)
    assert board.exchange([3, 4]) == [[3, 4]]
    board.close()


def test_a_rank_that_never_arrives_fails_the_meeting(host):
    errors = []

    def rank_zero():
        address, host_id = LAYOUTS[host]
        try:
            StepBoard.open(dist.HashStore(), 0, 2, 1, 1.0, 0.3, address, host_id and host_id(0))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=rank_zero)
    thread.start()
    thread.join(timeout=MEET_S)
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)


@pytest.mark.parametrize("world", [2, 8])
def test_many_rounds_stay_in_step(world, host):
    boards = open_boards(world, host)
    try:
        for round_ in range(50):
            tables = exchange_all(boards, [[rank * 100 + round_] for rank in range(world)])
            assert all(table == [[rank * 100 + round_] for rank in range(world)] for table in tables)
    finally:
        close_all(boards)


def test_across_hosts_a_connection_without_the_cluster_secret_is_refused_and_the_ranks_still_meet():
    """Rank 0 listens on a TCP port: a stranger who finds it first is turned away, not taken for rank 1."""
    store, world = dist.HashStore(), 2
    with ThreadPoolExecutor(world) as pool:
        zero = pool.submit(StepBoard.open, store, 0, world, 1, 5.0, MEET_S, "127.0.0.1", "host-0")
        store.set("meshserve/step-board/1/host/1", "host-1")
        store.wait(["meshserve/step-board/1/tcp"])
        listen_host, port = store.get("meshserve/step-board/1/tcp").decode().rsplit(":", 1)
        refused_before = cluster_auth.stats.tcp_refused
        with socket.create_connection((listen_host, int(port)), timeout=MEET_S) as stranger:
            with pytest.raises(cluster_auth.ClusterAuthError):
                cluster_auth.handshake_client(stranger, secret=b"not the cluster's secret")
        one = pool.submit(StepBoard.open, store, 1, world, 1, 5.0, MEET_S, "127.0.0.1", "host-1")
        boards = [zero.result(timeout=MEET_S), one.result(timeout=MEET_S)]
    try:
        assert cluster_auth.stats.tcp_refused == refused_before + 1
        assert exchange_all(boards, [[1, 2], [3, 4]]) == [[[1, 2], [3, 4]]] * 2
    finally:
        close_all(boards)


def test_ranks_of_one_host_meet_through_its_leader_and_rank_0_only_talks_to_the_leaders():
    """Eight ranks on three hosts, interleaved (host of rank r: r mod 3): the table is the same rank-ordered one
    on every rank, rank 0 holds one connection per other host plus its own host's ranks, and a member of another
    host talks only to its leader."""
    store, world = dist.HashStore(), 8
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(StepBoard.open, store, rank, world, 1, 5.0, MEET_S, "127.0.0.1", f"host-{rank % 3}")
                   for rank in range(world)]
        boards = [future.result(timeout=MEET_S) for future in futures]
    try:
        assert [ranks for _, ranks in boards[0]._children] == [[3], [6], [1, 4, 7], [2, 5]]
        assert [ranks for _, ranks in boards[1]._children] == [[4], [7]] and boards[4]._children == []
        assert boards[1]._up.family == socket.AF_INET and boards[4]._up.family == socket.AF_UNIX
        for round_ in range(30):
            rows = [[rank, round_, rank * round_] for rank in range(world)]
            assert exchange_all(boards, rows) == [rows] * world
        boards[5].close()  # a member of the third host leaves: every rank's next round fails
        results = exchange_all(boards[:5] + boards[6:], [[r] for r in range(world) if r != 5])
        assert all(isinstance(result, ConnectionError) for result in results), results
    finally:
        close_all(boards)

"""The step board (parallel/step_board.py): every rank's row reaches every rank in rank order, and a rank that
leaves, hangs or sends a different row fails its peers' round rather than leaving them waiting, on one host
(Unix sockets) and across hosts (TCP, loopback here). Ranks are threads here, each with its own sockets, meeting
in one in-process store."""
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


@pytest.fixture(params=[None, "127.0.0.1"], ids=["unix", "tcp"])
def host(request) -> str | None:
    """Where rank 0's board listens: None on one host (a Unix socket), an address when ranks span hosts."""
    return request.param


def open_boards(world: int, host: str | None, round_timeout_s: float = 5.0, generation: int = 1,
                store: dist.Store | None = None) -> list[StepBoard]:
    store = store or dist.HashStore()
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(StepBoard.open, store, rank, world, generation, round_timeout_s, MEET_S, host)
                   for rank in range(world)]
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
        assert store.get("meshserve/step-board/1") != store.get("meshserve/step-board/2")
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
        try:
            StepBoard.open(dist.HashStore(), 0, 2, 1, 1.0, 0.3, host)
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
        zero = pool.submit(StepBoard.open, store, 0, world, 1, 5.0, MEET_S, "127.0.0.1")
        store.wait(["meshserve/step-board/1"])
        listen_host, port = store.get("meshserve/step-board/1").decode().rsplit(":", 1)
        refused_before = cluster_auth.stats.tcp_refused
        with socket.create_connection((listen_host, int(port)), timeout=MEET_S) as stranger:
            with pytest.raises(cluster_auth.ClusterAuthError):
                cluster_auth.handshake_client(stranger, secret=b"not the cluster's secret")
        one = pool.submit(StepBoard.open, store, 1, world, 1, 5.0, MEET_S, "127.0.0.1")
        boards = [zero.result(timeout=MEET_S), one.result(timeout=MEET_S)]
    try:
        assert cluster_auth.stats.tcp_refused == refused_before + 1
        assert exchange_all(boards, [[1, 2], [3, 4]]) == [[[1, 2], [3, 4]]] * 2
    finally:
        close_all(boards)

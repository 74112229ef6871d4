"""The map over partitions and the exchange between them, in this process (a thread per
worker, a partition in memory per thread) or on a Dask cluster: results come back in
partition order, so they do not depend on which worker ran what, or when."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

from sdl_design.engine.cache import CACHE

Mapper = Callable[..., list]
Fold = Callable[[Any], None]  # a map's results, one at a time, in partition order


class InOrder:
    """Results arriving in any order handed to fold in partition order: each held only until
    the ones before it have come (with fold None, all kept: results())."""

    def __init__(self, n: int, fold: Fold | None):
        self.fold, self.next = fold, 0
        self.held: dict[int, Any] = {}
        self.out: list[Any] = [None] * n if fold is None else []

    def put(self, i: int, result: Any) -> None:
        if self.fold is None:
            self.out[i] = result
            return
        self.held[i] = result
        while self.next in self.held:
            self.fold(self.held.pop(self.next))
            self.next += 1

    def results(self) -> list:
        return self.out


class Exchange:
    """exchange(send, serve, receive, parts, *args, what=...): records move between partitions
    without passing through the driver. send(part_i, *args) gives one payload per partition
    j; serve(part_j, [payload i->j for every i], *args) one reply per partition i;
    receive(part_i, [reply j->i for every j], *args) the result, returned in partition order."""

    def __init__(self, map_fn: Mapper, exchange_fn: Callable[..., list]):
        self._map, self._exchange = map_fn, exchange_fn

    def __call__(
        self, fn: Callable, parts: Sequence, *args: Any, what: str, fold: Fold | None = None
    ) -> list:
        """fn(part, *args) of every part: the results in partition order; with fold, each
        result handed to fold in partition order as it arrives (held only until its turn)
        and an empty list returned."""
        return self._map(fn, parts, *args, what=what, fold=fold)

    def exchange(
        self,
        send: Callable,
        serve: Callable,
        receive: Callable,
        parts: Sequence,
        *args: Any,
        what: str,
    ) -> list:
        return self._exchange((send, serve, receive), parts, args, what)


def say(text: str, command: str = "scan") -> None:
    print(f"[puf {command}] {text}", file=sys.stderr, flush=True)


@contextmanager
def mapper(
    runner: str, dask_address: str | None, workers: int, command: str = "scan"
) -> Iterator[Exchange]:
    """map(fn, partitions, *args, what=...) -> results in partition order, with progress: in
    this process (runner 'thread': `workers` threads, as many partitions in memory at a time)
    or on a Dask cluster (the one at dask_address, else a local one of `workers`
    single-threaded processes)."""
    if runner == "thread":
        with (
            ThreadPoolExecutor(max(1, workers), thread_name_prefix="puf-partition") as pool,
            _cache_cleared(),
        ):

            def local(
                fn: Callable, parts: Sequence, *args: Any, what: str, fold: Fold | None = None
            ) -> list:
                out = InOrder(len(parts), fold)  # workers partitions at a time, in order
                for i, (p, got) in enumerate(
                    zip(parts, _in_pool(pool, fn, parts, args), strict=True), 1
                ):
                    out.put(i - 1, got)
                    del got
                    say(
                        f"{what}: partition {i}/{len(parts)} (records {p.start}-{p.stop - 1})",
                        command,
                    )
                return out.results()

            def local_exchange(fns: tuple, parts: Sequence, args: tuple, what: str) -> list:
                send, serve, receive = fns
                sent = local(send, parts, *args, what=f"{what}, requests")
                to = [[s[j] for s in sent] for j in range(len(parts))]
                served = list(pool.map(lambda j: serve(parts[j], to[j], *args), range(len(parts))))
                say(f"{what}: served {len(parts)} partitions", command)
                back = [[r[i] for r in served] for i in range(len(parts))]
                return list(
                    pool.map(lambda i: receive(parts[i], back[i], *args), range(len(parts)))
                )

            yield Exchange(local, local_exchange)
        return
    if runner != "dask":
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    from distributed import Client, LocalCluster

    cluster = None
    if dask_address:
        client = Client(dask_address)
    else:
        logging.getLogger("distributed").setLevel(logging.WARNING)  # no start-up chatter
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.WARNING,
        )
        client = Client(cluster)
    try:

        def on_dask(
            fn: Callable, parts: Sequence, *args: Any, what: str, fold: Fold | None = None
        ) -> list:
            # once, not per task; hash=False: a fresh key each map (a key reused from the
            # previous map may be released under the new tasks: "lost dependencies")
            shared = scattered(client, args)
            futures = [client.submit(fn, p, *shared, pure=False) for p in parts]
            return collected(futures, f"{what}: ", command, fold)

        def dask_exchange(fns: tuple, parts: Sequence, args: tuple, what: str) -> list:
            from operator import getitem

            send, serve, receive = fns
            shared = scattered(client, args)
            n = len(parts)
            sent = [client.submit(send, p, *shared, pure=False) for p in parts]
            to = [
                [client.submit(getitem, sent[i], j, pure=False) for i in range(n)] for j in range(n)
            ]
            served = [client.submit(serve, parts[j], to[j], *shared, pure=False) for j in range(n)]
            back = [
                [client.submit(getitem, served[j], i, pure=False) for j in range(n)]
                for i in range(n)
            ]
            got = [client.submit(receive, parts[i], back[i], *shared, pure=False) for i in range(n)]
            return collected(got, f"{what}: ", command)

        yield Exchange(on_dask, dask_exchange)
    finally:
        if cluster is None:  # a cluster that outlives the run: its workers' caches emptied
            with suppress(Exception):  # (a lost worker or scheduler: nothing to empty)
                client.run(_clear_cache)
        client.close()
        if cluster is not None:
            cluster.close()


def collected(futures: list, what: str, command: str, fold: Fold | None = None) -> list:
    """The Dask futures' results in partition order (or handed to fold): each fetched once as
    it ends (a worker's error raised here, whole) and then let go on the worker."""
    from distributed import as_completed

    at = {f.key: i for i, f in enumerate(futures)}
    out = InOrder(len(futures), fold)
    for done, f in enumerate(as_completed(futures), 1):
        i = at[f.key]
        out.put(i, f.result())
        futures[i] = f = None
        say(f"{what}{done}/{len(at)} partitions", command)
    return out.results()


def _clear_cache() -> None:
    """A worker's partition cache emptied (Client.run)."""
    CACHE.clear()


@contextmanager
def _cache_cleared() -> Iterator[None]:
    """The process's partition cache emptied when the run's maps end (a long-lived process,
    a Prefect worker, holds no run's columns)."""
    try:
        yield
    finally:
        CACHE.clear()


def _in_pool(pool: ThreadPoolExecutor, fn: Callable, parts: Sequence, args: tuple) -> Iterator:
    """fn(part, *args) of every part in the pool's threads, in partition order."""
    return pool.map(lambda p: fn(p, *args), parts)


def scattered(client: Any, args: tuple) -> list:
    """Each argument sent to every worker once, as one object (a dict or list is not split
    into its items; an empty one too)."""
    return [client.scatter([a], broadcast=True, hash=False)[0] for a in args]

"""How many trials per second one PostgreSQL server sustains for K sweep workers sharing one Optuna study.

    python -m benchmarks.optuna_storage                      # starts a throwaway local PostgreSQL (Debian's)
    python -m benchmarks.optuna_storage --url postgresql+psycopg2://user@dbhost/optuna --workers 1 8 32

Each worker process does what a lychee_optuna sweep worker and its trial's rank 0 do to the storage per trial,
with zero-length training: ask (TPE over the lr_batch space), two user attributes, three pruning reports each
followed by should_prune, tell, and a read of all trials (the results files are rewritten after every trial).
Prints trials/s and the median/p95 seconds per trial for each K. The figure is the storage's ceiling: real
trials last minutes, so K workers load it with K / trial_seconds trials/s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
import warnings

from benchmarks.local_postgres import local_postgres, server_bindir


def _worker(url: str, study_name: str, seconds: float, seed: int, out: mp.Queue) -> None:
    import optuna

    warnings.simplefilter("ignore")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True}, heartbeat_interval=60)
    study = optuna.load_study(
        study_name=study_name,
        storage=storage,
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
    )
    space = {
        "optimizer.lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True),
        "data.batch_size": optuna.distributions.CategoricalDistribution([2, 4, 8]),
    }
    durations = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        trial = study.ask(space)
        trial.set_user_attr("worker", [socket.gethostname(), os.getpid()])
        value = 0.0
        for step in (1, 2, 3):
            value = 0.5 + 0.1 * step * trial.params["optimizer.lr"] * 1e3
            trial.report(value, step)
            if trial.should_prune():
                break
        trial.set_user_attr("metrics", {"ndcg@10": value, "steps": 3})
        study.tell(trial, value)
        study.get_trials(deepcopy=False)  # the results rewrite
        durations.append(time.monotonic() - start)
    out.put(durations)


def measure(url: str, workers: int, seconds: float) -> dict:
    import optuna

    name = f"bench-k{workers}-{time.time_ns()}"
    optuna.create_study(study_name=name, storage=url, direction="maximize")
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_worker, args=(url, name, seconds, i, out)) for i in range(workers)]
    for proc in procs:
        proc.start()
    durations = [d for _ in procs for d in out.get()]
    for proc in procs:
        proc.join()
    durations.sort()
    return {
        "workers": workers,
        "trials": len(durations),
        "trials_per_s": len(durations) / seconds,
        "median_s": statistics.median(durations),
        "p95_s": durations[int(0.95 * (len(durations) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing database (default: start a throwaway local PostgreSQL)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="worker counts K to measure, one after another"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="measuring time per K")
    args = parser.parse_args()

    def run(url: str, server: str) -> None:
        print(f"storage: {server}; {os.cpu_count()} CPU(s) here shared by the server and the workers")
        print(f"{'K':>4} {'trials':>7} {'trials/s':>9} {'median s':>9} {'p95 s':>7}")
        for k in args.workers:
            r = measure(url, k, args.seconds)
            print(
                f"{r['workers']:>4} {r['trials']:>7} {r['trials_per_s']:>9.1f} {r['median_s']:>9.3f} "
                f"{r['p95_s']:>7.3f}",
                flush=True,
            )

    if args.url:
        run(args.url, "given URL")
    else:
        with local_postgres(max_connections=300) as url:
            run(url, f"local PostgreSQL {server_bindir().parent.name}")


if __name__ == "__main__":
    main()

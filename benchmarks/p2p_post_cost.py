"""Main-thread CPU to post one gloo point-to-point operation, two ways (2 gloo processes)::

    python benchmarks/p2p_post_cost.py [--ops 500] [--reps 6]

``dist``: ``batch_isend_irecv`` of ``P2POp``s on the receiver, ``dist.isend`` on the sender, as the
overlapped round posts them; ``pg``: the ProcessGroup's own ``recv`` / ``send`` (what those call on
gloo, without torch.distributed's Python checks).  Rank 0 posts ``--ops`` receives of 1 KiB, rank 1
the matching sends; prints rank 0's median thread CPU per operation (the first repetition is a
warm-up)."""
import argparse
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, init: str, n: int, reps: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.set_num_threads(1)
    bufs = [torch.empty(1024, dtype=torch.uint8) for _ in range(n)]
    pg = dist.group.WORLD
    res: dict[str, list[float]] = {}
    for it in range(reps + 1):
        for mode in ("dist", "pg"):
            dist.barrier()
            t = time.thread_time()
            if rank == 0:
                works = (dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, group_peer=1) for b in bufs])
                         if mode == "dist" else [pg.recv([b], 1, 0) for b in bufs])
            else:
                works = ([dist.isend(b, group_dst=0) for b in bufs] if mode == "dist"
                         else [pg.send([b], 0, 0) for b in bufs])
            post = time.thread_time() - t
            for w in works:
                w.wait()
            if it:
                res.setdefault(mode, []).append(post)
    if rank == 0:
        print({k: f"{sorted(v)[len(v) // 2] / n * 1e6:.1f} us" for k, v in res.items()}, "thread CPU per operation (median)")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=500)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    init = f"file://{tempfile.mkdtemp(prefix='p2p-post-')}/rendezvous"
    mp.spawn(worker, args=(init, a.ops, a.reps), nprocs=2)


if __name__ == "__main__":
    main()

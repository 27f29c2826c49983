"""Side-by-side measurements of aidaptiv_ds against DeepSpeed's own offload backends.

Modules (one job each):

* :mod:`.bench_io`: ``aidaptiv-ds bench-io`` (engine vs raw ``O_DIRECT`` vs DeepSpeed's compiled aio);
* :mod:`.models`: Llama shapes of a requested size (presets and parameter counts);
* :mod:`.backends`: the DeepSpeed config of each backend, identical except where offload differs;
* :mod:`.probes`: in-process measurements (I/O wait of the training thread, peak RSS);
* :mod:`.aio`: DeepSpeed's compiled ``async_io`` op for the native baseline (cache, preflight, timed waits);
* :mod:`.worker`: one training run of one backend, in its own process;
* :mod:`.runner`: launches a worker, watches its memory, collects its JSON;
* :mod:`.summary`: per-backend figures and ratios from worker results, the table;
* :mod:`.compare`: ``aidaptiv-ds compare`` (interleaved repeats of every backend);
* :mod:`.large`: the large-model run (training state larger than the machine's RAM).
"""

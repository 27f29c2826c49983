"""Small inputs on which DeepSpeed 0.19.8's own NVMe offload fails (``../shared/cases/deepspeed-nvme-cases.md``).

Uses the cases' shared harness (bias-free ``Linear(H, H)`` layers, ``tanh(x) * 2``, mean of squares)
through the public DeepSpeed API only, so the same script runs on DeepSpeed's CPU offload (the
reference), DeepSpeed's own NVMe swappers (with our pure-Python aio handle, nothing compiled) and
aidaptiv_ds. Prints one JSON line with the per-step losses (and case-specific facts).

    python tests/scripts/ds_cases.py --case two_engines --backend aidaptiv --path /tmp/x
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29612")
# bit-comparable GEMMs in every backend whatever the machine's load: alignment-independent (MKL_CBWR) and on a
# fixed thread count (MKL picks fewer threads when the cores are busy; the aidaptiv_ds runtime pins it too);
# read when MKL starts, so before torch is imported
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

H = 1024


class MLP(nn.Module):
    def __init__(self, n=4, h=H, again=False, ckpt=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n))
        self.again, self.ckpt = again, ckpt

    def forward(self, x):
        if self.ckpt == "reentrant" and torch.is_grad_enabled():  # reentrant checkpointing needs a grad input
            x = x.detach().requires_grad_()
        for layer in self.layers:
            if self.ckpt is not None:
                x = torch.utils.checkpoint.checkpoint(lambda t, m=layer: torch.tanh(m(t)) * 2, x,
                                                      use_reentrant=self.ckpt == "reentrant")
            else:
                x = torch.tanh(layer(x)) * 2
        if self.again:  # a module called twice in one forward
            x = torch.tanh(self.layers[0](x)) * 2
        return x.float().pow(2).mean()


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, H)
        self.mid = nn.Linear(H, H, bias=False)
        self.head = nn.Linear(H, 4096, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.mid(self.emb(ids)))).float().view(-1, 4096),
                                           ids.view(-1))


def cfg(a, path, dtype="bf16", **zero_extra) -> dict:
    dev = "cpu" if a.backend == "cpu" else "nvme"
    c = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": dev, "nvme_path": path, "pin_memory": False,
                              "buffer_count": 16, "buffer_size": 1e7, "max_in_cpu": 0},
            "offload_optimizer": {"device": dev, "nvme_path": path, "pin_memory": False},
            **zero_extra},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
    }
    if dtype == "bf16":
        c["bf16"] = {"enabled": True}
    if a.backend == "aidaptiv":
        c["aidaptiv"] = {"enabled": True, "cache_paths": [path], "dram_budget": a.budget}
    return c


def build(c, ctor, dtype=torch.bfloat16):
    import deepspeed
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=c):
        m = ctor()
    eng, *_ = deepspeed.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad], config=c)
    return eng


def batch(i, rank=0, dtype=torch.bfloat16, h=H):
    g = torch.Generator().manual_seed(1000 + 10 * i + rank)
    return torch.randn(2, h, generator=g).to(dtype)


def train(eng, steps, start=0, make=batch):
    out = []
    for i in range(start, start + steps):
        loss = eng(make(i, eng.global_rank))
        eng.backward(loss)
        eng.step()
        out.append(float(loss))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--backend", choices=["cpu", "aidaptiv", "native"], required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--budget", default="0")
    a = ap.parse_args()
    os.makedirs(a.path, exist_ok=True)
    if a.backend == "native":
        from aidaptiv_ds.integration.aio_handle import register_with_deepspeed
        register_with_deepspeed()
    import aidaptiv_ds  # noqa: F401 - installs the hooks

    result: dict = {}
    if a.case == "two_engines":  # B03: a second zero.Init / engine on the same nvme_path
        c = cfg(a, a.path)
        eng_a = build(c, lambda: MLP(8))
        la = train(eng_a, 1)
        eng_b = build(cfg(a, a.path), lambda: MLP(2))
        result["b"] = train(eng_b, 1)
        la += train(eng_a, 3, start=1)
        result["losses"] = la
    elif a.case == "one_engine":  # B03 reference: engine A alone
        eng_a = build(cfg(a, a.path), lambda: MLP(8))
        result["losses"] = train(eng_a, 4)
    elif a.case == "mlp4":  # reference of duplicate_prefetch
        result["losses"] = train(build(cfg(a, a.path), lambda: MLP(4)), 4)
    elif a.case == "small_buffers":  # B01: buffer_size below the largest partition
        c = cfg(a, a.path)
        c["zero_optimization"]["offload_param"].update(buffer_size=1e6, buffer_count=5)
        eng = build(c, lambda: nn.Sequential(nn.Linear(512, 2048, bias=False), nn.Linear(2048, 2048, bias=False),
                                             nn.Linear(2048, 512, bias=False)))

        def mk(i, rank):
            return batch(i, rank, h=512)
        result["losses"] = []
        for i in range(2):
            loss = eng(mk(i, 0)).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
            result["losses"].append(float(loss))
    elif a.case == "fp32_default_buffers":  # issue 3: DeepSpeed asserts "Not enough buffers 0 for swapping 1"
        from transformers import LlamaConfig, LlamaForCausalLM
        c = cfg(a, a.path, dtype="fp32")
        for k in ("buffer_count", "buffer_size"):
            c["zero_optimization"]["offload_param"].pop(k)
        conf = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
        torch.manual_seed(0)
        model = LlamaForCausalLM(conf)
        import deepspeed
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=c)
        result["losses"] = []
        for i in range(3):
            ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(i))
            loss = eng(ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
            result["losses"].append(float(loss))
    elif a.case == "duplicate_prefetch":  # seams §5: the coordinator may pass [2, 3, 3, 2]
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus as S
        eng = build(cfg(a, a.path), lambda: MLP(4))
        result["losses"] = train(eng, 2)
        ps = list(eng.module.parameters())
        sw = ps[0].nvme_swapper
        sw.swap_in([ps[2], ps[3], ps[3], ps[2]], async_op=True)
        sw.swap_in([ps[1], ps[3], ps[1]], async_op=False)  # sync: completes every pending read
        result["status"] = [p.ds_tensor.status.name for p in ps]
        result["all_available"] = all(p.ds_tensor.status == S.AVAILABLE for p in ps[1:4])
        sw.remove_partition_and_release_buffers(ps)
        result["losses"] += train(eng, 2, start=2)
    elif a.case == "unaligned":  # B05: element counts not multiple of the I/O block, bf16
        eng = build(cfg(a, a.path), lambda: nn.Sequential(nn.Linear(1000, 1049, bias=False),
                                                           nn.Linear(1049, 1003, bias=False)))

        def mk(i, rank):
            return batch(i, rank, h=1000)
        result["losses"] = []
        for i in range(3):
            loss = eng(mk(i, 0)).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
            result["losses"].append(float(loss))
    elif a.case in ("tied", "called_twice", "ckpt_reentrant", "ckpt_nonreentrant"):  # B12
        if a.case == "tied":
            eng = build(cfg(a, a.path), TiedLM)

            def mk(i, rank):
                return torch.randint(0, 4096, (2, 8), generator=torch.Generator().manual_seed(i))
        else:
            ck = {"ckpt_reentrant": "reentrant", "ckpt_nonreentrant": "nonreentrant"}.get(a.case)
            eng = build(cfg(a, a.path), lambda: MLP(3, again=a.case == "called_twice", ckpt=ck))
            mk = batch
        result["losses"] = train(eng, 3, make=mk)
        eng.eval()
        with torch.no_grad():
            result["eval"] = float(eng(mk(99, 0)))
    else:
        raise SystemExit(f"unknown case {a.case}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    from aidaptiv_ds.process_group import run_worker

    run_worker(main)  # no abort at exit with gloo (aidaptiv_ds/process_group.py)

"""Two nodes for real (issue 40): two network namespaces joined by a veth pair, one rank per node.

Each node is a network namespace with an interface ``eth1`` (the two ends of one veth pair) at
``10.200.N.1`` / ``10.200.N.2`` (``N`` from this process's id; the addresses exist only inside the
namespaces, which the module removes at the end), its own cache path, its own ``AIDAPTIV_HOSTNAME``
(the machine's host name resolves to ``127.0.0.1`` in both, as in many containers), and its own
"disk" bind-mounted at one path, ``node-local``, in the node's own mount namespace (``ip netns exec``
gives every command one): the layout of DeepSpeed's ``checkpoint.use_node_local_storage``. A
directory both nodes see stands for a shared filesystem.

The launch commands are the ones ``launch/MULTINODE.md`` documents, read from it and run as written
but for the node count, addresses, port, job id and script (:func:`as_run`). DeepSpeed's pdsh mode
runs with ``tests/scripts/netns_remote.py`` standing in for ``pdsh`` and ``ssh`` (neither exists here).

Runs (tiny Llama, bf16, gradient accumulation 2, 4 steps, DRAM budget 0): DeepSpeed's CPU offload
(the oracle); aidaptiv_ds saving after step 2 into the node-local path, a path per node and the
shared directory; one node with 2 ranks (the bytes each rank writes to its cache); a resume from
the node-local checkpoint whose next save is cut by ``kill -9`` of node-b, then a clean resume; a
resume from the shared directory with the pdsh mode; a refused resume with node-b's part gone.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch
from _oracle import REPO, SCRIPT, free_port
from test_multirank import LEDGER_FILES, _env, _results, assert_identical, files_under, written_bytes

pytestmark = pytest.mark.multirank

MULTINODE = os.path.join(REPO, "launch", "MULTINODE.md")
ARGS = ["--model", "llama", "--dtype", "bf16", "--ga", "2", "--steps", "4", "--budget", "0", "--hidden", "64"]
SAVE = 2  # saved after this many steps; the kill -9 cuts the save after step 3
NODE_LOCAL = json.dumps({"checkpoint": {"use_node_local_storage": True}})
HOSTS = ("node-a", "node-b")
TIMEOUT = 420
WALL: dict[str, float] = {}  # seconds per run, printed at the end


# ---------------------------------------------------------------------------------------------- the commands of the doc
def doc_commands() -> list[str]:
    """Every command of MULTINODE.md's ``bash`` blocks, continuation lines joined, comments dropped."""
    with open(MULTINODE, encoding="utf-8") as f:
        text = f.read()
    out = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        cur = ""
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line.rstrip())
            if line.endswith("\\"):
                cur += line[:-1].strip() + " "
                continue
            cur += line.strip()
            if cur:
                out.append(re.sub(r"\s+", " ", cur))
            cur = ""
    return out


def doc_hostfile() -> list[str]:
    with open(MULTINODE, encoding="utf-8") as f:
        return re.findall(r"^10\.0\.0\.\d+ slots=\d+$", f.read(), re.M)


def documented(pattern: str) -> str:
    """The one documented command matching ``pattern``."""
    got = [c for c in doc_commands() if re.search(pattern, c)]
    assert len(got) == 1, f"launch/MULTINODE.md should hold one command matching {pattern!r}, found {got}"
    return got[0]


DOC = {
    "torchrun-a": r"^GLOO_SOCKET_IFNAME=eth1 torchrun --nnodes 2 .*--rdzv_conf is_host=1 --local_addr 10\.0\.0\.1 ",
    "torchrun-b": r"^GLOO_SOCKET_IFNAME=eth1 torchrun --nnodes 2 .*--rdzv_conf is_host=0 --local_addr 10\.0\.0\.2 ",
    "deepspeed-env": r"^echo GLOO_SOCKET_IFNAME=eth1 > \.deepspeed_env$",
    "deepspeed-pdsh": r"^deepspeed --hostfile hostfile --master_addr 10\.0\.0\.1 ",
    "no-ssh-a": r"^GLOO_SOCKET_IFNAME=eth1 deepspeed --hostfile hostfile --no_ssh --node_rank 0 ",
    "no-ssh-b": r"^GLOO_SOCKET_IFNAME=eth1 deepspeed --hostfile hostfile --no_ssh --node_rank 1 ",
}


def as_run(cmd: str, cluster: Cluster, port: int, script_args: list[str]) -> list[str]:
    """A documented command as this test runs it: 1 rank per node, the namespaces' addresses, a free
    port, a job id of its own, and the oracle script in place of ``train.py --deepspeed ds_config.json``."""
    assert cmd.endswith(" train.py --deepspeed ds_config.json"), cmd
    cmd = cmd[: -len(" train.py --deepspeed ds_config.json")]
    cmd = cmd.replace("--nproc_per_node 8", "--nproc_per_node 1").replace("10.0.0.1", cluster.addr[0]) \
        .replace("10.0.0.2", cluster.addr[1]).replace("29500", str(port)).replace("job42", f"aidaptiv-{port}")
    return ["env", *shlex.split(cmd), SCRIPT, *script_args]


# ---------------------------------------------------------------------------------------------- the two nodes
class Cluster:
    """Two network namespaces joined by a veth pair (``eth1`` in each), node disks and a shared directory."""

    def __init__(self, root: str) -> None:
        pid = os.getpid()
        self.root = root
        self.ns = [f"aidaptiv-{pid}-{h}" for h in HOSTS]
        net = f"10.200.{pid % 250 + 1}"
        self.addr = [f"{net}.1", f"{net}.2"]
        self.disks = [os.path.join(root, f"disk-{h}") for h in HOSTS]  # each node's own disk ...
        self.local = os.path.join(root, "node-local")  # ... mounted here on that node
        self.shared = os.path.join(root, "shared")  # seen by both, as a network filesystem would be
        self.made: list[str] = []

    def up(self) -> str | None:
        """Make the namespaces; the reason when this machine cannot (None when it did)."""
        if os.geteuid() != 0:
            return "needs root to make network namespaces (ip netns) and bind mounts"
        if shutil.which("ip") is None:
            return "needs iproute2's `ip` to make network namespaces"
        for d in (*self.disks, self.local, self.shared):
            os.makedirs(d, exist_ok=True)
        steps = [["ip", "netns", "add", self.ns[0]], ["ip", "netns", "add", self.ns[1]],
                 ["ip", "link", "add", "eth1", "netns", self.ns[0], "type", "veth", "peer", "name", "eth1", "netns",
                  self.ns[1]]]
        for i in range(2):
            steps += [["ip", "netns", "exec", self.ns[i], "ip", "addr", "add", f"{self.addr[i]}/24", "dev", "eth1"],
                      ["ip", "netns", "exec", self.ns[i], "ip", "link", "set", "eth1", "up"],
                      ["ip", "netns", "exec", self.ns[i], "ip", "link", "set", "lo", "up"]]
        for argv in steps:
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0:
                return f"`{' '.join(argv)}` failed: {p.stderr.strip()}"
            if argv[1:3] == ["netns", "add"]:
                self.made.append(argv[3])
        probe = os.path.join(self.disks[1], ".probe")
        open(probe, "w").close()
        p = subprocess.run(self.on(1, ["test", "-e", os.path.join(self.local, ".probe")]), capture_output=True,
                           text=True)
        os.unlink(probe)
        if p.returncode != 0:
            return f"a bind mount inside the node's namespace failed: {p.stderr.strip() or p.returncode}"
        return None

    def down(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def on(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``i``: in its network namespace, with its disk mounted at :attr:`local`."""
        return ["ip", "netns", "exec", self.ns[i], "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"',
                "sh", self.disks[i], self.local, *argv]

    def env(self, i: int, extra: dict | None = None) -> dict:
        return _env(dict({"AIDAPTIV_HOSTNAME": HOSTS[i]}, **(extra or {})))

    def node_dir(self, i: int, *rel: str) -> str:
        """What node ``i`` sees at ``<node-local>/<rel>`` (its disk, from outside its namespace)."""
        return os.path.join(self.disks[i], *rel)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("two-nodes")))
    why = c.up()
    try:
        if why:
            pytest.skip(f"two nodes in network namespaces: {why}")
        yield c
    finally:
        c.down()
        assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
            f"aidaptiv-{os.getpid()}-") == 0
        if WALL:
            print("\ntwo-node runs (wall seconds): " + ", ".join(f"{k} {v:.1f}" for k, v in WALL.items())
                  + f"; total {sum(WALL.values()):.1f}")


def run_nodes(cluster: Cluster, name: str, argvs: list[list[str] | None], envs: list[dict], cwd: str,
              expect_ok: bool = True) -> list[str]:
    """Start ``argvs[i]`` on node i (None: nothing on that node), wait for all, return their outputs."""
    os.makedirs(cwd, exist_ok=True)
    procs, logs = [], []
    t0 = time.monotonic()
    for i, argv in enumerate(argvs):
        if argv is None:
            continue
        log = open(os.path.join(cwd, re.sub(r"[^\w.-]+", "_", name) + f"-{HOSTS[i]}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(cluster.on(i, argv), env=envs[i], cwd=cwd, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    WALL[name] = time.monotonic() - t0
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    if expect_ok:
        assert codes == [0] * len(procs), f"{name}: exit codes {codes}:\n" + "\n----\n".join(o[-6000:] for o in outs)
    return outs


def torchrun(cluster: Cluster, name: str, wd: str, backend: str, args: list[list[str]],
             extra_env: list[dict] | None = None, expect_ok: bool = True) -> list[str]:
    """The documented torchrun commands, one per node; ``args[i]``: node i's script arguments."""
    port = free_port()
    argvs = [as_run(documented(DOC[f"torchrun-{'ab'[i]}"]), cluster, port, script_args(backend, wd) + args[i])
             for i in range(2)]
    envs = [cluster.env(i, (extra_env or [{}, {}])[i]) for i in range(2)]
    return run_nodes(cluster, name, argvs, envs, wd, expect_ok)


def script_args(backend: str, wd: str) -> list[str]:
    return ["--backend", backend, "--cache", os.path.join(wd, "cache"), "--out", os.path.join(wd, f"{backend}.pt"),
            "--rank_out", os.path.join(wd, "ranks"), *ARGS]


def per_node_cache(wd: str, i: int) -> list[str]:
    return ["--cache_paths", os.path.join(wd, f"cache-{HOSTS[i]}")]


# ------------------------------------------------------------------------------------------- runs shared by the tests
@pytest.fixture(scope="module")
def oracle(cluster):
    wd = os.path.join(cluster.root, "oracle")
    torchrun(cluster, "oracle (cpu offload)", wd, "cpu", [[], []])
    return _results(wd, "cpu", 2)


def save_dirs(cluster: Cluster, i: int) -> str:
    """Where node i saves after step 2: the node-local path, a path of its own, the shared directory."""
    return ",".join([os.path.join(cluster.local, "ck"), os.path.join(cluster.root, f"pernode-{HOSTS[i]}", "ck"),
                     os.path.join(cluster.shared, "ck")])


@pytest.fixture(scope="module")
def trained(cluster, oracle):
    wd = os.path.join(cluster.root, "aidaptiv")
    torchrun(cluster, "aidaptiv + 3 saves", wd, "aidaptiv",
             [["--save_at", str(SAVE), "--save_dir", save_dirs(cluster, i), "--ds_extra", NODE_LOCAL,
               *per_node_cache(wd, i)] for i in range(2)])
    return _results(wd, "aidaptiv", 2)


def assert_resumed(ref: dict, got: dict, first: int) -> None:
    """A run resumed after ``first`` steps ends as the uninterrupted oracle: the losses of the steps it
    ran, every rank's fp32 master partitions and the gathered parameters, bit for bit."""
    tail = dict(ref, losses=ref["losses"][first:], ranks=[dict(r, losses=r["losses"][first:]) for r in ref["ranks"]])
    assert_identical(tail, got)


def leftovers(root: str) -> list[str]:
    """Staging, set-aside and claim files anywhere under ``root``."""
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.join(d, n) for n in dirs + files if n.startswith((".aidaptiv-staging", ".aidaptiv-retired",
                                                                          ".aidaptiv-save."))]
    return out


def manifest(tag_path: str) -> dict:
    with open(os.path.join(tag_path, "aidaptiv", "MANIFEST.json")) as f:
        return json.load(f)


def commit(tag_path: str) -> dict | None:
    p = os.path.join(tag_path, "aidaptiv", "COMMIT.json")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


def latest(save_dir: str) -> str | None:
    p = os.path.join(save_dir, "latest")
    return open(p).read().strip() if os.path.isfile(p) else None


# ---------------------------------------------------------------------------------------------- tests
def test_the_documented_commands_carry_the_flags_multi_homed_hosts_need():
    """Each launch command this module runs is in launch/MULTINODE.md once, as run here."""
    for pattern in DOC.values():
        documented(pattern)
    assert doc_hostfile() == ["10.0.0.1 slots=8", "10.0.0.2 slots=8"]


def test_two_nodes_train_bit_identical_and_save_a_part_per_node(cluster, oracle, trained):
    assert trained["swapper"] == "AidaptivParamSwapper"
    assert_identical(oracle, trained)
    assert [r["host"] for r in trained["ranks"]] == list(HOSTS)
    assert len({r["run"] for r in trained["ranks"]}) == 1  # rank 0's run name reached the other node
    for host in HOSTS:  # each node's cache path: its own directory, removed at a clean exit but for the ledger
        cache = os.path.join(cluster.root, "aidaptiv", f"cache-{host}", "aidaptiv_ds")
        assert os.listdir(cache) == [host] and {os.path.basename(f) for f in files_under(cache)} == LEDGER_FILES
    tag = f"global_step{SAVE}"
    ids = set()
    for i, host in enumerate(HOSTS):
        pernode = os.path.join(cluster.root, f"pernode-{host}", "ck")
        for seen, save_dir in ((os.path.join(cluster.local, "ck"), cluster.node_dir(i, "ck")), (pernode, pernode)):
            man, rec = manifest(os.path.join(save_dir, tag)), commit(os.path.join(save_dir, tag))
            assert man["part"] == {"index": i, "count": 2, "ranks": [i], "host": host, "save_dir": seen}
            assert sorted(os.listdir(os.path.join(save_dir, tag, "aidaptiv"))) == ["COMMIT.json", "MANIFEST.json",
                                                                                    f"rank0000{i}"]
            assert rec is not None and rec["save_id"] == man["save_id"] and [p["host"] for p in rec["parts"]] == \
                list(HOSTS)
            assert latest(save_dir) == tag
            ids.add((save_dir.startswith(cluster.disks[i]), man["save_id"]))
    assert len(ids) == 2  # one save id for the node-local path, one for the per-node paths
    assert os.listdir(cluster.local) == []  # written on each node's own disk, not at the mount point
    whole = os.path.join(cluster.shared, "ck", tag)
    assert manifest(whole)["world_size"] == 2 and "part" not in manifest(whole) and commit(whole) is None
    assert sorted(os.listdir(os.path.join(whole, "aidaptiv"))) == ["MANIFEST.json", "rank00000", "rank00001"]
    assert leftovers(cluster.root) == []


def test_bytes_per_node_equal_one_node_running_both_ranks(cluster, trained):
    """The same training and saves on one node with 2 ranks: every rank wrote the same bytes to its cache
    path, so a node of the two-node run writes per parameter and step what a rank of one node does."""
    wd = os.path.join(cluster.root, "one-node")
    t0 = time.monotonic()
    single = ",".join(os.path.join(wd, d) for d in ("local{rank}/ck", "pernode{rank}/ck", "shared/ck"))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), SCRIPT, *script_args("aidaptiv", wd), "--save_at", str(SAVE), "--save_dir",
                        single, "--ds_extra", NODE_LOCAL], env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    WALL["one node, 2 ranks"] = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-6000:]
    one = _results(wd, "aidaptiv", 2)
    assert_identical(trained, one)
    nparams, steps = trained["nparams"], len(trained["losses"])
    per_node = [sum(written_bytes(r)) for r in trained["ranks"]]
    per_rank = [sum(written_bytes(r)) for r in one["ranks"]]
    print(f"cache bytes written per parameter per step: two nodes {[b / nparams / steps for b in per_node]} per "
          f"node; one node {[b / nparams / steps for b in per_rank]} per rank, {sum(per_rank) / nparams / steps} "
          f"per node ({nparams} parameters, {steps} steps)")
    assert per_node == per_rank and min(per_node) > 0


def test_export_and_gc_over_the_nodes_directories(cluster, trained, tmp_path, capsys):
    """``aidaptiv-ds export`` given both nodes' directories writes the same model as from the shared
    checkpoint of the same step; given one, it names the other node's part; ``gc --checkpoint`` lists
    each node's part and finds nothing left over."""
    from safetensors.torch import load_file

    from aidaptiv_ds.cli.main import main as cli

    tag = f"global_step{SAVE}"
    nodes = [cluster.node_dir(i, "ck") for i in range(2)]
    assert cli(["export", *nodes, "--tag", tag, "--output", str(tmp_path / "parts")]) == 0
    assert cli(["export", os.path.join(cluster.shared, "ck"), "--tag", tag, "--output", str(tmp_path / "whole")]) == 0
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("parts", "whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert cli(["export", nodes[0], "--tag", tag, "--output", str(tmp_path / "one")]) == 1
    err = capsys.readouterr().err
    assert (f"the part of node node-b (ranks [1]), which it saved to {os.path.join(cluster.local, 'ck')} on that "
            f"node, is not among the directories given") in err
    assert cli(["gc", "--checkpoint", nodes[1]]) == 0
    out = capsys.readouterr().out
    assert f"tag      {os.path.join(nodes[1], tag)}: part 2 of 2 (ranks [1]), save " in out and "committed" in out
    assert "nothing left by interrupted saves" in out


def test_kill_9_of_one_node_during_a_save_leaves_the_previous_checkpoint_on_both(cluster, oracle, trained):
    """Resume from the node-local checkpoint of step 2 and save step 3; node-b's rank is killed once its
    part is staged whole (manifest written, before the switch). Both nodes stop; both still name step 2
    in ``latest``, step 3 is staged and uncommitted on both. The next resume takes step 2; its save
    of step 3 first removes the staged parts on both nodes (the nodes compare what they hold: no commit
    record anywhere), then saves; the run ends bit-identical with the oracle, step 3 committed on both."""
    ck = os.path.join(cluster.local, "ck")
    resume = ["--resume", "--ckpt_dir", ck, "--save_at", str(SAVE + 1), "--ds_extra", NODE_LOCAL]
    wd = os.path.join(cluster.root, "killed")
    outs = torchrun(cluster, "kill -9 of node-b mid-save", wd, "aidaptiv", [resume + per_node_cache(wd, i)
                                                                            for i in range(2)],
                    extra_env=[{}, {"AIDAPTIV_TEST_KILL_AT": "before_switch"}], expect_ok=False)
    assert "exitcode  : -9" in outs[1], outs[1][-3000:]  # node-b's rank died of SIGKILL
    assert "ChildFailedError" in outs[0], outs[0][-3000:]  # node-a's rank failed on its lost peer
    step3 = f"global_step{SAVE + 1}"
    for i in range(2):
        assert latest(cluster.node_dir(i, "ck")) == f"global_step{SAVE}"
        assert not os.path.isdir(cluster.node_dir(i, "ck", step3))
    staged = cluster.node_dir(1, "ck", ".aidaptiv-staging", step3)
    assert manifest(staged)["part"]["ranks"] == [1] and commit(staged) is None  # node-b's part, whole, uncommitted

    wd = os.path.join(cluster.root, "resumed-node-local")
    outs = torchrun(cluster, "resume node-local", wd, "aidaptiv", [resume + per_node_cache(wd, i) for i in range(2)])
    assert f"removed {os.path.join(cluster.local, 'ck', '.aidaptiv-staging', step3)}" in outs[1]  # node-b's leftover
    assert_resumed(oracle, _results(wd, "aidaptiv", 2), SAVE)
    recs = [commit(cluster.node_dir(i, "ck", step3)) for i in range(2)]
    assert recs[0] is not None and recs[0] == recs[1]
    assert [latest(cluster.node_dir(i, "ck")) for i in range(2)] == [step3, step3]
    assert leftovers(cluster.root) == []


def test_doctor_on_a_node_warns_that_its_host_name_is_loopback(cluster):
    """In node-a's namespace the host name resolves to 127.0.0.1: ``doctor --nnodes 2`` warns and gives the
    flags with this node's interface and address."""
    p = subprocess.run(cluster.on(0, [sys.executable, "-m", "aidaptiv_ds.cli.main", "doctor", "--nnodes", "2",
                                      "--json"]), env=cluster.env(0, {"GLOO_SOCKET_IFNAME": "eth9"}),
                       capture_output=True, text=True, timeout=300)
    net = json.loads(p.stdout)["network"]
    assert net["loopback"] and net["nnodes"] == 2
    loop, gloo = net["problems"]
    assert "a loopback address" in loop["problem"]
    assert f"--local_addr {cluster.addr[0]}" in loop["fix"] and "(interfaces here: eth1 " in loop["fix"]
    assert "GLOO_SOCKET_IFNAME=eth9, but this node has no such interface" in gloo["problem"]


def test_resume_from_the_shared_directory_with_deepspeeds_pdsh_mode(cluster, oracle, trained, tmp_path):
    """``deepspeed --hostfile`` without ``--no_ssh`` from node-a, as documented (``.deepspeed_env`` carries
    GLOO_SOCKET_IFNAME to node-b); pdsh and ssh are stand-ins running the command in the host's namespace."""
    sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))
    import netns_remote

    wd = os.path.join(cluster.root, "pdsh")
    os.makedirs(wd, exist_ok=True)
    with open(os.path.join(wd, "hostfile"), "w") as f:
        f.write("\n".join(h.replace("10.0.0.1", cluster.addr[0]).replace("10.0.0.2", cluster.addr[1])
                          .replace("slots=8", "slots=1") for h in doc_hostfile()) + "\n")
    p = subprocess.run(documented(DOC["deepspeed-env"]), shell=True, cwd=wd)
    assert p.returncode == 0 and open(os.path.join(wd, ".deepspeed_env")).read() == "GLOO_SOCKET_IFNAME=eth1\n"
    bin_dir = str(tmp_path / "bin")
    netns_remote.install(bin_dir)
    hosts = {cluster.addr[i]: {"netns": cluster.ns[i], "env": cluster.env(i),
                               "mount": [cluster.disks[i], cluster.local]} for i in range(2)}
    env = cluster.env(0, {"AIDAPTIV_TEST_HOSTS": json.dumps(hosts)})
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    argv = as_run(documented(DOC["deepspeed-pdsh"]), cluster, free_port(),
                  script_args("aidaptiv", wd) + ["--resume", "--ckpt_dir", os.path.join(cluster.shared, "ck")])
    run_nodes(cluster, "resume shared (deepspeed, pdsh)", [argv, None], [env, None], wd)
    got = _results(wd, "aidaptiv", 2)
    assert_resumed(oracle, got, SAVE)
    assert [r["host"] for r in got["ranks"]] == list(HOSTS)


def test_a_missing_part_is_refused_on_every_node_naming_it(cluster, trained):
    """node-b's part of the per-node-path checkpoint is gone: with ``--no_ssh`` per node as documented, both
    nodes refuse to resume, naming node-b and the path (plain DeepSpeed would resume node-b from nothing)."""
    gone = os.path.join(cluster.root, "pernode-node-b", "ck", f"global_step{SAVE}")
    os.rename(gone, gone + ".moved")
    wd = os.path.join(cluster.root, "refused")
    os.makedirs(wd, exist_ok=True)
    with open(os.path.join(wd, "hostfile"), "w") as f:
        f.write(f"{cluster.addr[0]} slots=1\n{cluster.addr[1]} slots=1\n")
    port = free_port()
    argvs = [as_run(documented(DOC[f"no-ssh-{'ab'[i]}"]), cluster, port,
                    script_args("aidaptiv", wd) + ["--resume", "--ckpt_dir",
                                                   os.path.join(cluster.root, f"pernode-{HOSTS[i]}", "ck")])
             for i in range(2)]
    try:
        outs = run_nodes(cluster, "refused resume (deepspeed --no_ssh)", argvs, [cluster.env(i) for i in range(2)], wd,
                         expect_ok=False)
    finally:
        os.rename(gone + ".moved", gone)
    for out in outs:
        assert f"node node-b (rank 1): {gone} is missing" in out, out[-4000:]
        assert "IncompleteCheckpointError" in out

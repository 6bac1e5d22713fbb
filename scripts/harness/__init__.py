"""The fault-injection harness that the tests and the benchmarks share: local jobs of real agents
on this machine, the faults done to them, and what is measured of their recoveries. The scripts
beside this package (scripts/local_cluster.py, scripts/bench_*.py) are its command lines.

    nodes            a job's node processes: torchrevive agents, plain torchrun (start, signal, kill)
    workloads        the jobs they train: the MLP sized by its state, the compiled GPT
    scenarios        one job, faults in turn, each recovery timed from the event log
    faults           faults that report their own checks (partition, slow link, CPU hog, etcd leader)
    baselines        the same fault on plain torchrun, torchft or ft_launcher
    chaos            a soak of random faults, then the finished job checked against a reference
    netns            nodes in network namespaces of their own; a link cut, healed or slowed
    etcd_server      a real etcd (or a cluster of them) on free ports
    ports            free ports, and waiting for a listener
    torchft_cluster, nvrx_cluster, peers_env   the peers' launchers and their own environment
"""

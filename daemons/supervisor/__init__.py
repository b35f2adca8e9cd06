"""The per-node supervisor: starts, watches, probes, restarts and stops every child.

Shaped like gunicorn's arbiter: producers only post events, one loop applies
them, and that loop is the single writer of the child table.

    producers (post an event)            the loop (core.py), every <= 0.1 s
    -------------------------            ----------------------------------
    signal handlers   SignalReceived     1. wait for an event (or the tick)
    exit watchers     Exited             2. apply it and all queued ones:
    spawn tasks       Spawned              on_signal  stop, or rolling.begin
                      SpawnFailed          on_spawned record pid, watch its exit
    control socket    Ready, Heartbeat     on_exit    reap: decode, out of routing,
    prober            ProbeResult                     policy.decide -> restart/stay/give up
                      ClusterSeen          on_ready   STARTING -> READY
    coordinator link  Fatal                on_probe   count failures -> declare_dead
    load table (SUB)  TableSeen            TableSeen  cluster.apply (every rank's state)
    launcher restart  LauncherRestarted    DrainRequested  draining.apply (drain, undrain,
    health port       DrainRequested                       retire, rolling restart of ranks)
                                         3. tick: NodeHello, cluster.check_head,
                                           kill overdue, spawn due restarts,
                                           startup.check (READY=1 or exit 3),
                                           rolling.advance, sweep_strays,
                                           policy.node_exit_code (exit 4/5)
                                         4. notify: STATUS=, WATCHDOG=1

Spawning never blocks the loop (a prefork launcher may take seconds): spawn()
starts a task that posts Spawned. Files: events.py (the event kinds),
policy.py (the pure restart decision), core.py (the loop and its verbs),
startup.py (deadlines and the READY=1 verdict), rolling.py (SIGHUP's
one-at-a-time restart, and the ranks'), draining.py (`dpserve drain`,
`undrain`, `retire`, `rolling-restart`: the health port's verbs), boot.py (what exists before the first turn: sockets,
keys, the launcher, the plan), shutdown.py, cluster.py (every rank of the
deployment, from the coordinator's load table), views.py (the read-only
NodeView that the health port, the prober, the STATUS= line and `dpserve
status` read: one readiness verdict for all). The children: plan.py (which
children this node runs, with their configs), children.py (a child's record
and how it starts), launcher.py (the prefork parent of the API servers),
probes.py, health.py (the node's health port), notify.py (sd_notify).

This __init__ imports nothing: take the loop from core (`from
dpserve.daemons.supervisor.core import Supervisor`), so a child that needs
only launcher.py or children.py does not load the whole supervisor.
"""

"""The rank process: one DP rank's sockets, heartbeats, load reports and busy loop
around an engine (a RankEngine). The process is the same whichever engine runs in it."""

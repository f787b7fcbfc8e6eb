"""The Monarch launcher and supervisor behind scripts/launch_monarch.py (docs/monarch.md):
command_line.py (options, train.py's arguments, their checks), main.py (the entry: checks, then the
supervisor), supervisor.py (the controller's loop: failures, restarts, stop signals),
replica_group.py (one group's mesh and ranks per attempt), trainer_actor.py (the actor that runs one
train.py rank), die_with_parent.py (a rank dies with its actor's process), schedulers.py (local,
Slurm, Kubernetes hosts through Monarch's job kinds), lighthouse.py (torchft's, for replica
groups), progress.py (last logged step, latest checkpoint)."""

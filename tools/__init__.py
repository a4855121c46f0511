"""Tools of the repository, not of the installed package: the builders of the shipped data and tiny models, and a
throwaway Slurm cluster on this machine. Run from the repository root as `python -m tools.<name>`."""

"""What ``python -m remat`` runs: the demo, the trade-off bench, the trials
they share and the plots."""

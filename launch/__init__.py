"""The entry points (`python launch/train.py ...`) and the campaign tools they share with
`projects/` (`from launch import campaign, seed_stats`)."""

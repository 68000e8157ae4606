"""Example environments shipped with CleanRLHF, to show how to bring your own (`--env-id module:Id`)."""

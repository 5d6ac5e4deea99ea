"""Tests of the pure parts: no process, no socket, no model run."""

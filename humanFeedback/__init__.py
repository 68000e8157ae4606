"""The human feedback server (feedback_server.py), its labelling page (static/) and its database schema (schema.sql)."""

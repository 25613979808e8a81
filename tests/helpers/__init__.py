"""Shared test helpers: tiny offline models (:mod:`.tiny_models`) and a pytest plugin (:mod:`.fixtures`)."""

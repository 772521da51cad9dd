"""Registered adaptation operators (``expand``, ``truncate``); one module each, discovered by the registry."""

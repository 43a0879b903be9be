"""Tern past one machine: the same app served by Ray Serve (`python -m deploy.ray_serve`), N engine replicas behind
one ingress, with a request router that sends a prompt to the replica whose prefix cache holds its start.

Optional: needs requirements-ray.txt. Above app.py in the direction of dependencies (it serves app.py's app once per
replica); nothing in app.py, engine/, api/ or ui/ imports it.
"""

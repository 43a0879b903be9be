"""Tern past one machine: the same app served by Ray Serve (`python -m deploy.ray_serve`), N engine replicas behind
one ingress, with a request router that sends a prompt to the replica whose prefix cache holds its start.

Optional: needs requirements-ray.txt. Beside app.py in the direction of dependencies (it serves tern/factory.py's app
once per replica, with tern/settings.py's flags); nothing in app.py, tern/, engine/, api/ or ui/ imports it.
"""

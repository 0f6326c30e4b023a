"""Data shipped with relayout: ``geometries/``, ``devices/``, ``atlases/`` and ``schemas/`` (JSON).

A regular package, so that ``importlib.resources`` sees one folder however relayout is installed;
read it through :func:`containers.jsonfile.shipped_dir`.
"""

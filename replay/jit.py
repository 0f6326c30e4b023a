"""How the replay model's compiled loops are built (numba, cached on disk after the first run).

``LOOP`` is for the loops that walk a whole trace and allocate their working arrays once.
``HELPER`` is for the small functions they call per instance or per read: these allocate
nothing, so they are built without reference counting (``_nrt=False``, as numba builds its own
string helpers); otherwise every call pays an atomic increment and decrement per array argument.
``error_model="numpy"`` drops division-by-zero checks: every divisor is a validated size or rate.
"""

LOOP = dict(cache=True, error_model="numpy")
HELPER = dict(LOOP, _nrt=False)

"""The ``lmspd`` command: ``main`` (the parser and its commands), ``serve`` (binds, runs the app
under Hypercorn, tells systemd), ``doctor``, ``units`` and ``systemd`` (service units and
sd_notify), ``progress`` (pull bars) and ``tasks`` (``lmspd tasks ...`` over :mod:`lmspd.client`).

The top of the import order: it may import every room below it; nothing imports it. Heavy rooms
are imported inside the command that needs them, so ``lmspd --help`` starts fast."""

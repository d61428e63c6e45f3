"""The ``selfdraft`` subcommands, one module each (``train``, ``bench``, ``check``, ``export``,
``push``), each with ``add_parser(commands)`` and ``run(args) -> exit code``; :mod:`training.cli`
assembles them. Shared helpers live in :mod:`training.commands.common`."""

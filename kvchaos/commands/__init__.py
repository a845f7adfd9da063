"""The ``kvchaos`` commands, one module each.

Each module defines ``NAME`` (the subcommand), ``HELP`` (its line in ``kvchaos --help``),
``add_parser(sub, cfg)`` (adds its subparser and options, defaults from the ``[kvchaos]`` config table
``cfg``, and returns it) and ``run(args) -> int`` (the exit status). :data:`COMMANDS` is their order in
``kvchaos --help``; :func:`kvchaos.cli.build_parser` wires them up. What several share lives in
``_common`` (configuration, usage errors, option groups) and ``_pytest`` (a pytest session of suites).

Every module here is imported for ``kvchaos --help``: heavy imports (the cluster, ``kvchaos.report``,
rich, aiohttp) stay inside the ``run`` functions that need them.
"""

from kvchaos.commands import audit, bisect, digests, fuzz, judge, replay, report, repro, run, shrink, soak, up

COMMANDS = (up, run, repro, bisect, audit, report, replay, shrink, digests, soak, judge, fuzz)

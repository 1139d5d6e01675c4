"""The server's routes, one module per API: ``completions`` (``/v1/completions``), ``chat``
(``/v1/chat/completions``) and ``info`` (``/v1/models``, ``/health``, ``/version``, ``/metrics``). Each module's
``router`` is included by ``hyserve.server.app.build_app``; the routes reach what they share through the ``Context``
dependency (``hyserve.server.context``)."""

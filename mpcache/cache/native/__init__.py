"""mpcache's own front end: the Unix-socket transport, the dispatcher and the native operations
(``ops``) that native clients (``mpcache.client``) call."""

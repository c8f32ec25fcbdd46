"""Which optional tool each skipping fixture needs (a module of its own: ``conftest`` names several files,
so ``from conftest import`` reads whichever was imported first)."""

#: Fixtures that skip without an optional tool: a test using one, directly or through another fixture,
#: is marked ``needs(tool)``. Tests that check for a tool themselves carry the marker in their module.
NEEDS_BY_FIXTURE = {"redis_server": "redis-server", "private_redis": "redis-server", "stack": "redis-server"}

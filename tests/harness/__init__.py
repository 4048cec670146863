"""What the tests, the chaos runner and the benchmarks stand on; not part of the package.

- ``brokers``: the Kafka a test runs against (embedded, the kit's real broker, or a cluster of yours).
- ``kafka_kit``: real Kafka brokers started and stopped from a start script (one node, three, SASL_SSL).
- ``kafka_cluster``: topics and share-group configs made under names of our own, on either broker.
- ``support``: bounded waits, workloads and the no-loss checker, finding a query's processes.
- ``spark_hosts``: a Spark standalone cluster whose driver and workers are network-namespace "hosts".
- ``resources``: resource sampling of a run and the growth verdict.
- ``chaos``: the chaos runner (``./dev chaos``): random, overlapping faults on a continuous query.
"""

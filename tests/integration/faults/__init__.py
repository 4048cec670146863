"""The fault matrix (docs/guarantees.md, "The fault matrix"), one module per fault it injects: each row
injects one fault and checks that nothing is lost.

Rows 1-12 and the verdict rows run a query on both brokers (the embedded one, and real Kafka in the
real pass, where the rows that inject errors, 7 and 8, are skipped and row 9's outage is a stop and a
start of the broker) and print "no-loss: produced N / delivered N / duplicates N / lost 0", saying
which fault explains the duplicates. Rows 13-17 are the replay, zombie-read and stop-race rows: a
batch id that cannot be served with its first rows acquires nothing, and SIGTERM at any phase ACCEPTs
what Spark committed and RELEASEs the rest. A few tests pin the tracker's refusals those rows rely on.

- test_crash_before_commit.py: foreachBatch raises before Spark's commit (rows 1, 12)
- test_stop_mid_batch.py: q.stop() and SIGTERM in the middle of a batch (rows 2, 16)
- test_runner_and_worker_kills.py: the tracker's runner process or a Python worker is SIGKILLed (rows 3, 4)
- test_agent_lost.py: an agent is killed or lost (rows 5, 17, 18; a lost agent's slot reads nothing new)
- test_task_retries_and_rereads.py: task retries, two actions, re-execution with persist (rows 6, 11)
- test_broker_faults.py: ShareFetch and ShareAcknowledge errors, a leader move, the broker down (rows 7-9)
- test_short_lock.py: a batch outlives its record lock (row 10)
- test_user_verdicts.py: the application's REJECT and RELEASE verdicts (the verdict rows)
- test_dead_letter_failures.py: the dead-letter target refuses writes or finds fewer records
- test_replays_and_zombie_reads.py: replayed batch ids and late reads acquire nothing (rows 13-15)

helpers.py holds the stub agent connection and tracker helpers of the tracker-only rows.
"""

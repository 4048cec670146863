"""Between our processes: ``wire`` (the authenticated connection), ``frames`` (what it carries),
``endpoints`` (servers, and dialing one) and ``protocol`` (the messages, one named type each, and which
side handles which). Nothing here knows Kafka or Spark.
"""

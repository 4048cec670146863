"""Between our processes: ``wire`` (the authenticated connection and its frames) and ``protocol`` (the
messages, one named type each, and which side handles which). Nothing here knows Kafka or Spark.
"""

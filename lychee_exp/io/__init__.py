"""Files users give and files lychee_exp writes: a user's path resolved and their text files read line by line
(user_files); every write of every command under the output policy (outputs: where results go and what may be
replaced; atomic: whole or nothing; lock: one writer per output). A write elsewhere in the package is listed, with
its reason, in tests/test_writes.py. And what a long phase writes while it runs (progress: a bar on a terminal,
log lines elsewhere). May import: errors."""

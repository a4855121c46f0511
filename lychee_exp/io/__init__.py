"""Files users give and files lychee_exp writes: resolving a user's path (resources), reading a user's text file line
by line (textlines), and every write of every command under the output policy (outputs: where results go, what may
be replaced; atomic: whole or nothing; lock: one writer per output). A write elsewhere in the package is listed, with
its reason, in tests/test_writes.py."""

import sys

from shard.errors import exit_from
from shard.serve import main

exit_from(main, sys.argv[1:])

package bus

// ReadAhead is the readers' prefetch, for a baseline read that matches it.
const ReadAhead = readAhead
